"""Runs in every phase, on either side of the files a run leaves: where a run's side files lie (the
Snakefile declares them, ranks write them), metrics.json's one writer and one reader with the
metrics formulas and schema version, the per-phase memory peaks as recorded, and what makes
results shareable between machines (umask, no host names or local paths). Torch-free, so the
Snakefile, a job, a rank and the report can all import it.
"""
