"""Rule compute_probe: time the kernels of one probe key (device, dtype, threads, rows x
sequence, tensor-parallel degree, 4-bit weights) at one model's shapes, in a process of its own
(distlab.tools.compute_probe.run_probe: on CPU it starts warm, as ranks do)."""
from distlab.jobs.rule_log import logged
from distlab.tools.compute_probe import run_probe

with logged(snakemake):
    run_probe(snakemake.input.model, snakemake.wildcards.key, snakemake.wildcards.model, snakemake.output[0])
