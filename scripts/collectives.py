"""Rule collectives: the bandwidth benchmark's ranks on this machine (distlab.tools.collectives.run_benchmark,
through the rank service training and validation use: they die with this job)."""
from distlab.tools.collectives import run_benchmark
from distlab.jobs.rule_log import logged

with logged(snakemake):
    # No timeout, as for training: the rule's runtime is the scheduler's. Output goes to the rule's log.
    run_benchmark(dict(snakemake.params.plan), snakemake.output[0], snakemake.params.machine)
