"""Runs inside a Snakemake job, in the process that starts ranks and waits for them, never inside a
rank: one experiment's launch (job file, GPUs held, status) and its further launches, checkpoint
validation's driver, GPU locks for concurrent jobs, the two-host Ray run, and the rule log every Snakemake script
writes to. How ranks are started is distlab.launchers'.
"""
