"""The report's picture of a text-to-image run: the same prompts and seeds sampled by a plain
StableDiffusionPipeline with the base UNet (top row) and with the run's tuned UNet (bottom
row), everything else shared (VAE, text encoder, the folder's own inference scheduler), saved
as one PNG in the run's run_files/ (a declared output the report reads)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

SAMPLES_PNG = "samples.png"
SAMPLES_JSON = "samples.json"


def pipeline_images(pipe, prompts: list[str], seeds: list[int], samples: dict, resolution: int) -> list:
    """One PIL image per (prompt, seed), each from its own seeded generator."""
    import torch

    images = []
    for prompt in prompts:
        for seed in seeds:
            out = pipe(prompt, num_inference_steps=samples["steps"], guidance_scale=samples["guidance_scale"],
                       height=resolution, width=resolution, generator=torch.Generator().manual_seed(seed),
                       output_type="pil")
            images.append(out.images[0])
    return images


def grid_png(rows: dict[str, list], labels: list[str], path: Path) -> None:
    """rows: {row title: images}; one column per label; pixels shown unsmoothed, enlarged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = len(labels)
    fig, axes = plt.subplots(len(rows), columns, figsize=(1.7 * columns, 2.1 * len(rows)), squeeze=False)
    for r, (title, images) in enumerate(rows.items()):
        for c, image in enumerate(images):
            axis = axes[r][c]
            axis.imshow(image, interpolation="nearest")
            axis.set_xticks([])
            axis.set_yticks([])
            if r == 0:
                axis.set_title(textwrap.fill(labels[c], 22), fontsize=7)
            if c == 0:
                axis.set_ylabel(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def sample_grid(tuned_unet, source: str, settings: dict, out_dir) -> dict:
    """Base vs tuned samples of the fixed prompts and seeds into out_dir/samples.png (+ .json)."""
    import torch
    from diffusers import StableDiffusionPipeline

    samples, resolution = settings["samples"], settings["resolution"]
    prompts, seeds = list(samples["prompts"]), list(samples["seeds"])
    base = StableDiffusionPipeline.from_pretrained(str(source), safety_checker=None, requires_safety_checker=False,
                                                   torch_dtype=torch.float32)
    base.set_progress_bar_config(disable=True)
    tuned = StableDiffusionPipeline(**{**base.components, "unet": tuned_unet.eval()})
    tuned.set_progress_bar_config(disable=True)
    rows = {"base": pipeline_images(base, prompts, seeds, samples, resolution),
            "tuned": pipeline_images(tuned, prompts, seeds, samples, resolution)}
    labels = [f"{prompt} (seed {seed})" for prompt in prompts for seed in seeds]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grid_png(rows, labels, out_dir / SAMPLES_PNG)
    record = {"path": f"{out_dir.name}/{SAMPLES_PNG}", "prompts": prompts, "seeds": seeds,
              "steps": samples["steps"], "guidance_scale": samples["guidance_scale"],
              "scheduler": type(base.scheduler).__name__, "resolution": resolution,
              "how": "StableDiffusionPipeline (the model folder's VAE, text encoder, tokenizer and scheduler) with "
                     "the base UNet, then with the run's consolidated LoRA UNet; one torch.Generator per image "
                     "seeded with its seed, fp32 on the CPU of rank 0"}
    (out_dir / SAMPLES_JSON).write_text(json.dumps(record, indent=1))
    return record
