"""The trained module of the text-to-image task: the UNet of a diffusers Stable Diffusion
folder, loaded whole, on the meta device (FSDP2 shards it, then reads each rank's slices) or
built under deepspeed.zero.Init (ZeRO-3: each rank copies only its partitions); LoRA through
`unet.add_adapter`; FLOPs per image counted with FlopCounterMode over one UNet step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from distlab.records.spec import Spec

UNET = "unet"
WEIGHTS = "diffusion_pytorch_model.safetensors"


def load_unet(source: str, dtype=None, device: str | None = None):
    """UNet2DConditionModel of `source`, frozen (LoRA adds the trainable weights). device="meta":
    the architecture only, no weight read (the UNet has no buffers to keep real)."""
    from diffusers import UNet2DConditionModel

    dtype = dtype or torch.float32
    if device == "meta":
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(source), subfolder=UNET))
        unet.to(dtype)
    elif device is None:
        unet = UNet2DConditionModel.from_pretrained(str(source), subfolder=UNET, torch_dtype=dtype,
                                                    use_safetensors=True)
    else:
        raise ValueError(f"load_unet: device {device!r}, expected None or 'meta'")
    unet.requires_grad_(False)
    unet.distlab_source = str(source)  # where FLOPs are sized from (the VAE's and tokenizer's configs)
    return unet


def lora_config(spec: Spec):
    """diffusers' example: gaussian init (the default init would leave step 0 untouched by the
    adapters), the spec's rank, alpha, dropout and targets (resolved: to_q, to_k, to_v, to_out.0)."""
    from peft import LoraConfig

    lora = spec.lora
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      init_lora_weights="gaussian", target_modules=list(lora["target_modules"]))


def add_lora(unet, spec: Spec):
    """(unet with a LoRA adapter, target names); seeded so every rank starts from the same adapters."""
    unet.requires_grad_(False)
    torch.manual_seed(spec.seed)
    try:
        unet.add_adapter(lora_config(spec))
    except ValueError as exc:  # peft: a target that matches no module
        raise ValueError(f"config field 'lora.target_modules': {exc}") from None
    trainable = [name for name, p in unet.named_parameters() if p.requires_grad]
    stray = [name for name in trainable if "lora_" not in name]
    if not trainable or stray:
        raise RuntimeError(f"LoRA left UNet parameters trainable: {stray[:5]}" if stray
                           else "LoRA produced no trainable UNet parameter")
    return unet, list(spec.lora["target_modules"])


# -- ZeRO-3: build partitioned, read each rank's partition ------------------------------------
def weight_files(folder: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of a diffusers model folder (one file or an index)."""
    from safetensors import safe_open

    index = folder / f"{WEIGHTS}.index.json"
    if index.is_file():
        from distlab.records.export_files import read_weight_map

        return {name: folder / file for name, file in read_weight_map(index).items()}
    single = folder / WEIGHTS
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no {WEIGHTS} (or its index) to load the UNet from")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def load_unet_partitioned(source: str, ds_config: dict, dtype, nvme_params: bool = False, *, zero) -> tuple:
    """The UNet built under deepspeed.zero.Init (each parameter a partition as its module is
    constructed), then each rank copies only its own flat slice of every weight from the
    safetensors (`zero`, the strategy's ZeRO-3 loader: its partition copy, the same as for causal LMs).
    Only the UNet is built here: the frozen VAE and text encoder load in the task's TrainData,
    outside zero.Init (as diffusers' ZeRO-3 recipe keeps them out: they are never trained).
    nvme_params: refused at config time (the copy needs the partitions in memory)."""
    from diffusers import UNet2DConditionModel
    from safetensors import safe_open


    folder = Path(source) / UNET
    with zero.zero_init(ds_config, dtype):  # not deepspeed.zero.Init(dtype=...): zero_init says why
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(source), subfolder=UNET))
    zero.check_built_dtype(unet, dtype, "the ZeRO-3 UNet")
    unet.requires_grad_(False)
    unet.distlab_source = str(source)
    where = weight_files(folder)
    params = dict(unet.named_parameters())
    missing = [name for name in params if name not in where]
    if missing:
        raise KeyError(f"ZeRO-3 load of the UNet: {len(missing)} parameters are not in {folder}'s safetensors, "
                       f"e.g. {missing[:3]}")
    # One block (down_blocks.0, mid_block, ...) at a time, each file closed after: pages read from
    # a memory-mapped file stay in RSS while it is open.
    groups: dict[tuple, list[str]] = {}
    for name in params:
        groups.setdefault((where[name], ".".join(name.split(".")[:2])), []).append(name)
    read = 0
    with torch.no_grad():
        for (path, _), names in groups.items():
            with safe_open(str(path), framework="pt") as handle:
                for name in names:
                    read += zero._copy_partition(params[name], handle.get_slice(name))
    return unet, {"how": "UNet built under deepspeed.zero.Init, then each rank copied only its own partition of "
                         "every weight from the safetensors (get_slice, rows covering it), one block at a time",
                  "bytes_read": read, "tensors": len(params)}


# -- FLOPs -------------------------------------------------------------------------------------
def _component_config(source: str, component: str, name: str) -> dict:
    path = Path(source) / component / name
    return json.loads(path.read_text()) if path.is_file() else {}


def step_shapes(source: str, unet_config, resolution: int) -> dict:
    """Shapes of one image's UNet step: latents (the VAE downsamples by 2 per block after the
    first) and the text encoder's hidden states (tokenizer max length x cross-attention width)."""
    vae = _component_config(source, "vae", "config.json")
    factor = 2 ** (len(vae.get("block_out_channels", [0])) - 1)
    tokens = _component_config(source, "tokenizer", "tokenizer_config.json").get("model_max_length")
    if not isinstance(tokens, int) or tokens > 4096:  # absent, or transformers' "unbounded" sentinel
        tokens = _component_config(source, "text_encoder", "config.json").get("max_position_embeddings", 77)
    side = resolution // factor
    return {"latents": [1, unet_config["in_channels"], side, side],
            "encoder_hidden_states": [1, tokens, unet_config["cross_attention_dim"]]}


def flops_per_image(model, spec: Spec, count: bool) -> dict:
    """FLOPs of one image's training step of the UNet (forward + backward, LoRA applied, the base
    frozen: no weight gradients for it), counted by torch's FlopCounterMode on a meta-device copy
    built from the UNet's config: the same figure for every strategy (whole, sharded or
    partitioned), no weight read, no memory. The frozen VAE encode and text encoder forward are
    not in it (MFU is the UNet's, as the issue's 'one UNet step')."""
    if not count:
        return {"flops_per_image": None, "counted_per_image": None, "how": "not counted on this rank",
                "mfu_uses": "counted"}
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    from distlab.records.metrics import _cpu_attention_flops

    shapes = step_shapes(model.distlab_source, model.config, spec.text_to_image["resolution"])
    try:
        with torch.random.fork_rng(devices=[]):  # the copy's LoRA init must not move the run's RNG
            with init_empty_weights(include_buffers=False):
                copy = UNet2DConditionModel.from_config(model.config)
            add_lora(copy, spec)
        latents = torch.zeros(shapes["latents"], device="meta")
        states = torch.zeros(shapes["encoder_hidden_states"], device="meta")
        timestep = torch.zeros(1, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False, custom_mapping=_cpu_attention_flops()) as counter:
            out = copy(latents, timestep, states, return_dict=False)[0]
            out.float().pow(2).mean().backward()
        counted = counter.get_total_flops()
        how = (f"torch.utils.flop_counter.FlopCounterMode over one forward+backward of the UNet with the run's LoRA "
               f"(base frozen), one image: latents {shapes['latents']}, text states {shapes['encoder_hidden_states']}; "
               "on a meta-device copy built from the UNet's config (attention runs its math path there and is "
               "counted as its matmuls); VAE encode and text encoder not included")
    except Exception as exc:  # a UNet this counter cannot run: say so (MFU is then not computed)
        counted, how = None, f"not counted: {type(exc).__name__}: {exc}"
    return {"flops_per_image": counted, "counted_per_image": counted, "how": how, "mfu_uses": "counted",
            "step_shapes": shapes}
