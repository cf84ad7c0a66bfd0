"""Rule compute_probe: time the kernels of one probe key (device, dtype, threads, rows x
sequence, tensor-parallel degree, 4-bit weights) at one model's shapes."""
import json

from distlab.jobs.rule_log import logged
from distlab.tools.compute_probe import probe
from distlab.runtime.parameter_counts import model_shape, parameter_counts
from distlab.tools.step_time import kernels_needed, parse_probe_key

with logged(snakemake):
    key = snakemake.wildcards.key
    config_json = json.loads(open(snakemake.input.model).read())
    shape = model_shape(config_json)
    kernels = kernels_needed(key, shape, parameter_counts(shape))
    found = probe(kernels, parse_probe_key(key)["device"], config_json)
    result = {"model": snakemake.wildcards.model, "key": key, **found}
    with open(snakemake.output[0], "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{len(found['kernels'])} kernel(s) timed for {snakemake.wildcards.model} at {key}")
