"""Rule compute_probe: time the kernels of every predicted experiment on one model."""
import json

from distlab.jobs.rule_log import logged
from distlab.tools.compute_probe import probe
from distlab.tools.step_time import kernels_needed, model_parts

with logged(snakemake):
    config_json = json.loads(open(snakemake.input.model).read())
    kernels, by_device = {}, {}
    for spec in snakemake.params.specs:
        shape, counts, _ = model_parts(spec, config_json)
        for kernel in kernels_needed(spec, shape, counts):
            by_device.setdefault(spec["device"], {})[f"{kernel['key']}|{kernel['dtype']}|{kernel['threads']}"] = kernel
    for device, wanted in by_device.items():
        found = probe(list(wanted.values()), device)
        kernels.update(found["kernels"])
        how = found["how"]
    result = {"model": snakemake.wildcards.model, "experiments": [spec["id"] for spec in snakemake.params.specs],
              "kernels": kernels, "how": how if by_device else "no experiment to probe"}
    with open(snakemake.output[0], "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{len(kernels)} kernel(s) timed for {len(snakemake.params.specs)} experiment(s)")
