"""What a text-to-image run leaves and how it is checked: the consolidated LoRA UNet (from any
strategy's whole_state), the held-out denoising loss (the same images, noise and timesteps
for the base model and every run), the sample grid, the LoRA export written the diffusers way
(pytorch_lora_weights.safetensors through StableDiffusionPipeline.save_lora_weights) and its
check in a plain StableDiffusionPipeline.load_lora_weights."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from distlab.records.spec import Spec
from distlab.records.job import Job
from distlab.tasks.text_to_image.data import FIXED_BATCH, FrozenEncoders, heldout_inputs, unet_outputs
from distlab.tasks.text_to_image.model import add_lora, load_unet

HELDOUT_HOW = ("mean over the eval split's {n} images of the UNet's denoising MSE (prediction vs the scheduler's "
               "target) at fixed noise and timesteps: center crop, no flip, each image's latent sample and noise "
               "from its own fixed generator, timesteps spread evenly over [0, {t}); fp32, eval mode, no grad")


def consolidated_unet(full_state: dict, source: str, spec: Spec):
    """A plain UNet2DConditionModel with the run's LoRA adapter holding a strategy's whole state
    (every parameter; buffers are the freshly loaded UNet's own)."""
    unet, _ = add_lora(load_unet(source), spec)
    missing, unexpected = unet.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in full_state.items()}, strict=False)
    missing = sorted(set(missing) - {name for name, _ in unet.named_buffers()})
    if missing or unexpected:
        raise ValueError(f"the trained state and the UNet disagree: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return unet.eval()


def heldout_loss(unet, source: str, data_dir, settings: dict) -> dict:
    frozen = FrozenEncoders(source)
    inputs = heldout_inputs(data_dir, frozen, settings)
    per_image = []
    for start in range(0, len(inputs["target"]), 8):
        part = {k: v[start:start + 8] for k, v in inputs.items()}
        prediction = unet_outputs(unet, part)
        per_image += ((prediction - part["target"].float()) ** 2).mean(dim=(1, 2, 3)).tolist()
    loss = sum(per_image) / len(per_image) if per_image else math.nan
    return {"loss": loss, "images": len(per_image),
            "how": HELDOUT_HOW.format(n=len(per_image), t=frozen.scheduler.config.num_train_timesteps)}


def evaluate_base(source: str, data_dir, out_path, settings: dict) -> dict:
    """Rule evaluate_base_sd: the untouched base UNet on the held-out images."""
    result = {"model": str(source), "data_dir": str(data_dir),
              **heldout_loss(load_unet(source), source, data_dir, settings)}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return result


def evaluate_run_unet(unet, job: Job) -> dict:
    """Rank 0 after training: held-out loss of the consolidated UNet, and the sample grid."""
    from distlab.records.run_layout import run_files_dir
    from distlab.tasks.text_to_image.samples import sample_grid

    settings = job.spec.text_to_image
    out = heldout_loss(unet, job.model_source, job.data_dir, settings)
    out["samples"] = sample_grid(unet, job.model_source, settings, run_files_dir(job.run_dir))
    return out


def fixed_outputs(unet, job: Job) -> torch.Tensor:
    """The UNet's prediction on the first FIXED_BATCH held-out images (fixed noise, timesteps)."""
    frozen = FrozenEncoders(job.model_source)
    return unet_outputs(unet, heldout_inputs(job.data_dir, frozen, job.spec.text_to_image, FIXED_BATCH))


def write_export(unet, source: str, spec: Spec, folder) -> dict:
    """diffusers' own LoRA file, as train_text_to_image_lora.py saves it, with peft's adapter
    config as metadata (so alpha != r loads right)."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    folder = Path(folder)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(save_directory=str(folder), unet_lora_layers=layers,
                                              unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
                                              safe_serialization=True)
    (folder / "distlab_export.json").write_text(json.dumps({
        "base_model": str(source), "weight_name": "pytorch_lora_weights.safetensors",
        "load_with": "StableDiffusionPipeline.from_pretrained(base_model).load_lora_weights(this folder)"}, indent=1))
    return {"format": "diffusers LoRA (pytorch_lora_weights.safetensors)", "lora_tensors": len(layers),
            "lora_adapter": True}


def check_export(validator) -> dict:
    """Rank 0 of validation: the export loaded as a user would (a plain StableDiffusionPipeline of
    the base folder + load_lora_weights), its UNet's output on the fixed batch vs the one recorded
    at save time, and a 2-step generation through the whole pipeline."""
    from diffusers import StableDiffusionPipeline

    from distlab.checkpoints import checkpoint as ckpt
    from distlab.records.validation import FAILED, PASSED, RELOAD_TOLERANCE

    job = validator.job
    folder = Path(job.final) / "export"
    if not folder.is_dir():
        meta = ckpt.read_meta(job.final)
        raise NotImplementedError((meta["save"].get("export") or {}).get("reason", "no export was written"))
    pipe = StableDiffusionPipeline.from_pretrained(job.model_source, safety_checker=None,
                                                   requires_safety_checker=False, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(folder))
    settings = job.spec.text_to_image
    frozen = FrozenEncoders(job.model_source)
    outputs = unet_outputs(pipe.unet, heldout_inputs(job.data_dir, frozen, settings, FIXED_BATCH))
    diff = (outputs - validator.saved_logits()).abs().max().item()
    image = pipe(settings["samples"]["prompts"][0], num_inference_steps=2, height=settings["resolution"],
                 width=settings["resolution"], generator=torch.Generator().manual_seed(0)).images[0]
    ok = diff <= RELOAD_TOLERANCE and image.size == (settings["resolution"],) * 2
    return {"status": PASSED if ok else FAILED, "path": str(folder), "max_abs_output_diff": diff,
            "tolerance": RELOAD_TOLERANCE, "generated_image_size": list(image.size),
            "how": "StableDiffusionPipeline.from_pretrained(base folder).load_lora_weights(export) in a validation "
                   "process; the UNet's prediction on the fixed held-out batch vs the one recorded at save time; "
                   "a 2-step generation of the first sample prompt"}


def frozen_base_report(peft_state: dict, base_state: dict) -> dict:
    """A LoRA UNet's full state against the base UNet's: every base weight bit-identical
    (torch.equal), none missing, none unknown."""
    from distlab.runtime.lora import base_name

    compared, changed, unknown, adapters = set(), [], [], 0
    for key, tensor in peft_state.items():
        name = base_name(key)
        if name is None:
            adapters += 1
        elif name not in base_state:
            unknown.append(key)
        else:
            compared.add(name)
            if not torch.equal(tensor.detach().cpu(), base_state[name].detach().cpu()):
                changed.append(name)
    return {"base_weights_compared": len(compared), "base_weights_changed": changed,
            "base_weights_missing": sorted(set(base_state) - compared), "unknown_keys": unknown,
            "adapter_tensors": adapters,
            "identical": not changed and not unknown and compared == set(base_state)}


def lora_base_frozen(unet, source: str, meta: dict, base: dict | None, reload_diff: float) -> dict:
    """The reloaded UNet's frozen weights vs a freshly loaded base UNet: bit for bit (the
    checkpoint's base identity was already checked by compatibility)."""
    from distlab.records.validation import FAILED, PASSED

    report = frozen_base_report(unet.state_dict(), load_unet(source).state_dict())
    return {"status": PASSED if report["identical"] else FAILED, **report,
            "base_weights_changed": report["base_weights_changed"][:20], "tolerance": "bit-identical (torch.equal)"}


# -- the collective hooks (distlab.tasks.base.Task): the UNet is consolidated on rank 0 ----------
# The Stable Diffusion UNets this task trains fit one process (SD 1.5's is 0.86B parameters, 3.4
# GB in fp32), so rank 0 evaluates, records and exports a whole consolidated copy; the causal LM
# streams its state one layer at a time instead (distlab.checkpoints.export).
def evaluate_trained(strategy, job: Job) -> dict | None:
    """Collective: the held-out loss (and sample grid) of the consolidated UNet, on rank 0."""
    import torch.distributed as dist

    if job.spec.memory_budget_gib is not None:
        # Rank 0's whole-UNet copy would count against the per-rank budget this run measures.
        return {"status": "not evaluated", "reason": "memory_budget_gib is set: the whole-UNet evaluation on rank "
                "0 would count against the per-rank budget this run measures"} if dist.get_rank() == 0 else None
    try:
        full = strategy.whole_state()
    except NotImplementedError as exc:  # every rank raises alike
        return {"status": "not evaluated", "reason": str(exc)} if dist.get_rank() == 0 else None
    if dist.get_rank() != 0:
        return None
    try:
        unet = consolidated_unet(full, job.model_source, job.spec)
        del full
        return evaluate_run_unet(unet, job)
    except Exception as exc:  # rank 0 only, after the collective: recorded, the run's training stands
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:500]}


def export_pass(strategy, job: Job, spec: Spec, folder) -> tuple[dict | None, str | None]:
    """Collective: rank 0 consolidates the UNet, records its output on the fixed batch
    (eval_logits.safetensors: `logits`) and writes the diffusers LoRA export. Returns (info on
    rank 0, rank 0's error or None), agreed on by every rank in checkpoint.save_checkpoint."""
    import time

    import torch.distributed as dist
    from safetensors.torch import save_file

    from distlab.runtime.memory import is_out_of_memory

    started = time.perf_counter()
    try:
        full = strategy.whole_state()
    except NotImplementedError as exc:  # every rank raises alike: the native state still counts
        return {"status": "unsupported", "reason": str(exc)}, None
    if dist.get_rank() != 0:
        return None, None
    try:
        unet = consolidated_unet(full, job.model_source, spec)
        del full
        save_file({"logits": fixed_outputs(unet, job).contiguous()}, str(Path(folder) / "eval_logits.safetensors"))
        info = write_export(unet, job.model_source, spec, Path(folder) / "export")
        return {**info, "seconds": time.perf_counter() - started}, None
    except Exception as exc:  # noqa: BLE001
        if is_out_of_memory(exc):
            raise
        return None, f"{type(exc).__name__}: {exc}"[:1000]


def trained_outputs(validator, strategy):
    """Collective (validation): (the consolidated UNet, its output on the fixed batch) on rank 0,
    (None, None) elsewhere."""
    full = strategy.whole_state()
    if validator.rank != 0:
        return None, None
    unet = consolidated_unet(full, validator.job.model_source, validator.spec)
    return unet, fixed_outputs(unet, validator.job)
