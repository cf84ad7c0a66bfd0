"""Rule build_sd_model: the tiny Stable Diffusion, written with StableDiffusionPipeline.save_pretrained."""
import os

from distlab.jobs.rule_log import logged
from distlab.tasks.text_to_image.prepare import build_tiny_sd

with logged(snakemake):
    counts = build_tiny_sd(snakemake.params.build, os.path.dirname(snakemake.output[0]))
    print("built a tiny Stable Diffusion: " + ", ".join(f"{name} {n:,} parameters" for name, n in counts.items()))
