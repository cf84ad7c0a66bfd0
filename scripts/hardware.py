"""Rule hardware: GPUs via pynvml (or none), the CPU, and a measured matmul peak."""
import json

from distlab.configuration.hardware import describe
from distlab.jobs.rule_log import logged

with logged(snakemake):
    info = describe(snakemake.params.machine)
    with open(snakemake.output[0], "w") as fh:
        json.dump(info, fh, indent=1)
    print(json.dumps(info, indent=1))
