"""Rule advise_sd: per-device memory of text-to-image LoRA for SD 1.5, SDXL, FLUX.1 and the configured folder."""
import json
import os

from distlab.tools.advisor_diffusion import GIB, advise_text_to_image
from distlab.jobs.rule_log import logged

with logged(snakemake):
    with open(snakemake.input.hardware) as fh:
        hardware = json.load(fh)
    advice = advise_text_to_image(hardware, dict(snakemake.params.advisor), os.path.dirname(snakemake.input.model[0]),
                                  snakemake.params.resolution, snakemake.params.cpu_ranks)
    with open(snakemake.output[0], "w") as fh:
        json.dump(advice, fh, indent=1)
    for row in advice["models"]:
        print(f"{row['model']}: DDP {row['ddp_bytes'] / GIB:.2f} GiB/device, sharded {row['sharded_bytes'] / GIB:.2f} "
              f"GiB/device over {row['devices']} -> {row['recommendation']}")
