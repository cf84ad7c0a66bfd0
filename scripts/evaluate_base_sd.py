"""Rule evaluate_base_sd: the base UNet's held-out denoising loss (fixed images, noise, timesteps)."""
import os

from distlab.jobs.rule_log import logged
from distlab.tasks.text_to_image.outputs import evaluate_base

with logged(snakemake):
    result = evaluate_base(os.path.dirname(snakemake.input.model[0]), snakemake.input.data, snakemake.output[0],
                           dict(snakemake.params.settings))
    print(f"base UNet held-out denoising loss {result['loss']:.4f} over {result['images']} images")
