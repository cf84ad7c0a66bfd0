"""Image-caption samples to UNet inputs, the way diffusers' train_text_to_image_lora.py does it:

    Resize(resolution) -> CenterCrop or RandomCrop(resolution) -> RandomHorizontalFlip (if
    random_flip) -> ToTensor -> Normalize([0.5], [0.5]); captions through the CLIP tokenizer
    (padding to model_max_length); latents = vae.encode(pixels).latent_dist.sample() *
    scaling_factor; noise; timesteps in [0, num_train_timesteps); noise_scheduler.add_noise;
    text_encoder(input_ids)[0]; the target is the noise (epsilon) or the velocity (v_prediction).

The transforms are written with PIL (torchvision, which the example uses, is not a dependency);
they follow torchvision's arithmetic (shorter side to `resolution`, int() of the long side;
center crop offset round((size - resolution) / 2); random offsets torch.randint(0, size -
resolution + 1)), after one step of their own: an image longer than MAX_ASPECT (4) x its
shorter side is first cut to its centre of that length (crop_to_aspect), as config refuses it
in the rows it checks. Every random draw of a sample comes from its own generator, seeded by (seed,
step, sample index), in the example's order: crop, flip, caption pick, latent sample, noise,
timestep.

The frozen VAE and text encoder live here, beside the data, in the run's precision: the
strategy never sees them (no wrapper, no ZeRO-3 partitioning, no FSDP sharding).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from distlab.records.spec import Spec
from distlab.configuration.precision import torch_dtype

INFO = "distlab_images.json"  # written by prepare.prepare_images beside the Arrow splits
EVAL_SEED = 20251203  # the held-out images' draws: one fixed stream per image, the same for every model
FIXED_BATCH = 2  # held-out images whose UNet output checkpoints record and checks compare


def sample_generator(seed: int, step: int, index: int) -> torch.Generator:
    """One random stream per (seed, step, sample): a sample's draws do not depend on which rank,
    micro-batch or strategy reads it."""
    return torch.Generator().manual_seed((((seed * 1_000_003) ^ (step + 7)) * 1_000_033 + index) % (2 ** 63))


def crop_to_aspect(image):
    """The centre of an image longer than MAX_ASPECT x its shorter side, cut to that length
    before anything resizes it: config checks only the first rows of each file, and the resize
    of the shorter side to the resolution would make a 1x100000 image 100 GB at 512 px. An
    image within the bound is returned as it is (the example's transform unchanged)."""
    from distlab.configuration.tasks.text_to_image.checks import MAX_ASPECT

    width, height = image.size
    keep = max(1, int(min(width, height) * MAX_ASPECT))
    if width > keep:
        left = (width - keep) // 2
        return image.crop((left, 0, left + keep, height))
    if height > keep:
        top = (height - keep) // 2
        return image.crop((0, top, width, top + keep))
    return image


def transform(image, settings: dict, generator: torch.Generator, train: bool) -> torch.Tensor:
    """The example's train_transforms on one PIL image (eval: center crop, no flip)."""
    from PIL import Image

    interpolation = getattr(Image.Resampling, settings["interpolation"].upper())
    image = crop_to_aspect(image).convert("RGB")
    size = settings["resolution"]
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    image = image.resize((size, new_long) if width <= height else (new_long, size), interpolation)
    width, height = image.size
    if settings["center_crop"] or not train:
        top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    else:
        top = int(torch.randint(0, height - size + 1, (1,), generator=generator))
        left = int(torch.randint(0, width - size + 1, (1,), generator=generator))
    image = image.crop((left, top, left + size, top + size))
    if train and settings["random_flip"] and float(torch.rand(1, generator=generator)) < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (pixels - 0.5) / 0.5


def pick_caption(caption, generator: torch.Generator, train: bool) -> str:
    """A caption, or one of a list of captions (train: a random one, eval: the first)."""
    if isinstance(caption, str):
        return caption
    return caption[int(torch.randint(0, len(caption), (1,), generator=generator))] if train else caption[0]


class FrozenEncoders:
    """The frozen parts of a Stable Diffusion folder: VAE, CLIP text encoder and tokenizer, and
    the noise scheduler the example trains with (DDPMScheduler from the folder's scheduler config)."""

    def __init__(self, source: str, dtype=torch.float32, device="cpu"):
        from diffusers import AutoencoderKL, DDPMScheduler
        from transformers import CLIPTextModel, CLIPTokenizer

        self.device, self.dtype = torch.device(device), dtype
        self.vae = AutoencoderKL.from_pretrained(str(source), subfolder="vae", torch_dtype=dtype, use_safetensors=True)
        self.text_encoder = CLIPTextModel.from_pretrained(str(source), subfolder="text_encoder", dtype=dtype,
                                                          use_safetensors=True)
        self.tokenizer = CLIPTokenizer.from_pretrained(str(source), subfolder="tokenizer")
        self.scheduler = DDPMScheduler.from_pretrained(str(source), subfolder="scheduler")
        for module in (self.vae, self.text_encoder):
            module.requires_grad_(False)
            module.eval()
            module.to(self.device)

    def encode(self, pixels: torch.Tensor, captions: list[str], generators: list, timesteps=None) -> dict:
        """The UNet's inputs and target for a batch of images (no grad: nothing here trains).
        timesteps None: each drawn from its sample's generator."""
        from diffusers.utils.torch_utils import randn_tensor

        with torch.no_grad():
            latents = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.sample(generator=generators)
            latents = latents * self.vae.config.scaling_factor
            noise = randn_tensor(latents.shape, generator=generators, device=latents.device, dtype=latents.dtype)
            if timesteps is None:
                steps = self.scheduler.config.num_train_timesteps
                timesteps = torch.cat([torch.randint(0, steps, (1,), generator=g) for g in generators])
            timesteps = timesteps.long().to(latents.device)
            noisy = self.scheduler.add_noise(latents, noise, timesteps)
            ids = self.tokenizer(captions, max_length=self.tokenizer.model_max_length, padding="max_length",
                                 truncation=True, return_tensors="pt").input_ids
            states = self.text_encoder(ids.to(self.device), return_dict=False)[0]
            prediction = self.scheduler.config.prediction_type
            if prediction == "epsilon":
                target = noise
            elif prediction == "v_prediction":
                target = self.scheduler.get_velocity(latents, noise, timesteps)
            else:
                raise ValueError(f"noise scheduler prediction_type {prediction!r}: epsilon or v_prediction")
        return {"noisy_latents": noisy, "timesteps": timesteps, "encoder_hidden_states": states, "target": target}

    def describe(self) -> dict:
        """What the frozen parts are, read from their tensors: a ZeRO-3 partition (ds_id) or a
        trainable weight among them would be a bug (distlab.strategies.base.FidelityError)."""
        out = {}
        for name, module in (("vae", self.vae), ("text_encoder", self.text_encoder)):
            params = list(module.parameters())
            out[name] = {"class": type(module).__name__, "parameters": sum(p.numel() for p in params),
                         "dtype": str(params[0].dtype), "device": str(params[0].device),
                         "zero3_partitioned": sum(hasattr(p, "ds_id") for p in params),
                         "trainable": sum(p.requires_grad for p in params)}
        out["noise_scheduler"] = {"class": type(self.scheduler).__name__,
                                  "prediction_type": self.scheduler.config.prediction_type,
                                  "num_train_timesteps": self.scheduler.config.num_train_timesteps}
        out["tokenizer"] = {"class": type(self.tokenizer).__name__, "max_length": self.tokenizer.model_max_length}
        return out


def frozen_dtype(spec: Spec):
    """The example casts the frozen VAE and text encoder to the mixed-precision dtype."""
    return torch_dtype(spec.precision)


def load_split(data_dir, split: str):
    import datasets

    return datasets.load_from_disk(str(data_dir))[split]


class ImageCaptions:
    """TrainData of the text-to-image task (distlab.tasks.base.TrainData): the prepared images of
    one split and the frozen encoders that turn them into UNet inputs."""

    def __init__(self, data_dir, source: str, spec: Spec, device, split: str = "train"):
        from distlab.errors import FidelityError

        self.rows = load_split(data_dir, split)
        self.settings, self.seed = spec.text_to_image, spec.seed
        self.frozen = FrozenEncoders(source, frozen_dtype(spec), device)
        described = self.frozen.describe()
        bad = [name for name in ("vae", "text_encoder")
               if described[name]["zero3_partitioned"] or described[name]["trainable"]]
        if bad:
            raise FidelityError(f"frozen {bad} hold ZeRO-3 partitions or trainable weights: {described}")

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices, device, step):
        # `device` is the rank's, where the frozen encoders already sit (they put the batch there).
        generators = [sample_generator(self.seed, step, index) for index in indices]
        rows = self.rows[list(indices)]
        pixels = torch.stack([transform(image, self.settings, g, train=True)
                              for image, g in zip(rows["image"], generators)])
        captions = [pick_caption(c, g, train=True) for c, g in zip(rows["text"], generators)]
        return self.frozen.encode(pixels, captions, generators)

    def describe(self) -> dict:
        return {"name": "text-to-image", "trained_module": "UNet2DConditionModel (LoRA)",
                "frozen": self.frozen.describe(), **{k: self.settings[k] for k in
                                                     ("resolution", "center_crop", "random_flip", "interpolation")},
                "how": "VAE, text encoder and noise scheduler loaded by the task on every rank outside any "
                       "strategy (no wrapper, no deepspeed.zero.Init, no fully_shard), frozen, in the run's "
                       "precision; counts read from their tensors"}


def denoising_loss(model, batch: dict, num_items=None) -> torch.Tensor:
    """MSE between the (possibly wrapped) UNet's prediction and the target, in fp32 as the example.
    Inputs are cast to the module's parameter dtype (DeepSpeed keeps a bf16 module in bf16 runs).
    num_items None: the micro-batch's mean; else its per-image means summed over the step's image
    count (distlab.runtime.accumulation): the step optimises the mean over its images."""
    dtype = next(iter(model.parameters())).dtype
    prediction = model(batch["noisy_latents"].to(dtype), batch["timesteps"],
                       batch["encoder_hidden_states"].to(dtype), return_dict=False)[0]
    mean = F.mse_loss(prediction.float(), batch["target"].float(), reduction="mean")
    return mean if num_items is None else mean * len(batch["target"]) / num_items


def images_in(batch: dict) -> int:
    """What a step's denoising loss is a mean over: images."""
    return len(batch["target"])


# -- held-out images: fixed crops, noise and timesteps -------------------------------------------
def heldout_inputs(data_dir, frozen: FrozenEncoders, settings: dict, count: int | None = None) -> dict:
    """The eval split's first `count` images (all when None) as UNet inputs, identical for every
    model: center crop, no flip, the first caption, each image's draws from its own fixed generator,
    timesteps spread evenly over [0, num_train_timesteps) (the loss depends strongly on t)."""
    rows = load_split(data_dir, "eval")
    n = len(rows) if count is None else min(count, len(rows))
    rows = rows[:n]
    generators = [sample_generator(EVAL_SEED, -1, index) for index in range(n)]
    pixels = torch.stack([transform(image, settings, g, train=False) for image, g in zip(rows["image"], generators)])
    captions = [pick_caption(c, g, train=False) for c, g in zip(rows["text"], generators)]
    steps = frozen.scheduler.config.num_train_timesteps
    timesteps = torch.tensor([int((i + 0.5) * steps / n) for i in range(n)])
    return frozen.encode(pixels, captions, generators, timesteps=timesteps)


def unet_outputs(unet, inputs: dict) -> torch.Tensor:
    """The UNet's prediction on fixed inputs (eval mode, no grad, fp32)."""
    unet.eval()
    with torch.no_grad():
        return unet(inputs["noisy_latents"], inputs["timesteps"], inputs["encoder_hidden_states"],
                    return_dict=False)[0].float()


def data_facts(data_dir, records_by_rank: list) -> dict:
    info_path = Path(data_dir) / INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    read = sum(len(rec["samples"]) for recs in records_by_rank for rec in recs)
    return {"format": "image-caption", "prepared": info,
            "run_images": {"read": read, "how": "images every rank's micro-batches read, summed"}}
