"""Text-to-image: LoRA fine-tuning of a Stable Diffusion UNet, trained the way diffusers'
examples/text_to_image/train_text_to_image_lora.py does it:

    latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
    noise, timesteps ~ N(0, I), U{0, num_train_timesteps}
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    loss = mse(unet(noisy, timesteps, text_encoder(input_ids)[0]), noise or the velocity)

Only the UNet is trained (peft LoRA on to_q, to_k, to_v, to_out.0 via unet.add_adapter) and
only the UNet is handed to a strategy; the VAE, text encoder and noise scheduler are frozen
(in the run's precision) inside this task's TrainData, never wrapped, sharded or partitioned.

Every sample's random draws (crop, flip, the VAE's latent sample, noise, timestep) come from
its own generator seeded by (seed, step, sample index): a sample gets the same noise whatever
the world size, micro-batch or strategy, so step-0 losses compare across all of them and with
a plain diffusers loop (tests/test_text_to_image.py).

Pieces: the declaration and its checks (parse time: distlab/configuration/tasks/text_to_image/),
prepare (rules: the tiny SD, the image data), model (UNet loading, LoRA, FLOPs), data
(transforms, batches, held-out batches), outputs (evaluation, sample grid, export and its check).
"""
from __future__ import annotations

from pathlib import Path

from distlab.configuration.tasks.text_to_image import TextToImageDeclaration
from distlab.tasks.base import Task, lazy

MODEL, DATA, OUTPUTS = (f"distlab.tasks.text_to_image.{name}" for name in ("model", "data", "outputs"))


class TextToImage(TextToImageDeclaration, Task):
    def import_code(self, source, lora):
        import peft  # noqa: F401
        from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401
        from transformers import CLIPTextModel  # noqa: F401

    def weights_folder(self, source):
        return str(Path(source) / "unet")

    def train_data(self, job, spec, device, split="train"):
        from distlab.tasks.text_to_image.data import ImageCaptions

        return ImageCaptions(job.data_dir, job.model_source, spec, device, split)

    def data_facts(self, job, records_by_rank, ranks_per_replica):
        from distlab.tasks.text_to_image.data import data_facts

        return data_facts(job.data_dir, records_by_rank)

    load_model = lazy(f"{MODEL}:load_unet")
    load_partitioned = lazy(f"{MODEL}:load_unet_partitioned")
    apply_lora = lazy(f"{MODEL}:add_lora")
    flops = lazy(f"{MODEL}:flops_per_image")
    loss = lazy(f"{DATA}:denoising_loss")
    loss_items = lazy(f"{DATA}:images_in")
    evaluate_trained = lazy(f"{OUTPUTS}:evaluate_trained")
    export_pass = lazy(f"{OUTPUTS}:export_pass")
    trained_outputs = lazy(f"{OUTPUTS}:trained_outputs")
    check_export = lazy(f"{OUTPUTS}:check_export")
    lora_base_frozen = lazy(f"{OUTPUTS}:lora_base_frozen")


TASK = TextToImage()
