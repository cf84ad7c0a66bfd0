"""The advisor for text-to-image LoRA: Stable Diffusion 1.5, SDXL and FLUX.1 sized from their
public configs (and the configured SD folder), per device, answered by the roadmap's table
("Stable Diffusion: low difficulty, xformers + data parallel is enough"; "FLUX: medium, may
need model parallel").

Everything is computed, nothing typed in: each model is built from its config on the meta
device (diffusers / transformers classes, no weights), its parameters counted, the run's LoRA
(rank 4 on to_q, to_k, to_v, to_out.0) added, and one bf16 forward of micro-batch 1 at the
model's resolution run on meta tensors while autograd's saved-tensor hooks add up the bytes
kept for backward (parameters excluded). Attention is counted as a memory-efficient kernel
(xformers / flash / SDPA's fused kernels, which the roadmap assumes): it keeps q, k, v, the
output and a log-sum-exp, never the L x L score matrix (meta tensors would take the math path).

Bytes per device, LoRA, bf16 frozen weights, fp32 adapters with AdamW, N devices:
  DDP:               2*Psi_denoiser + 2*Psi_frozen + 20*T + activations
  ZeRO-3 / FSDP:     2*Psi_denoiser/N + 2*Psi_frozen + 16*T/N + activations
(T = LoRA parameters: weights 4, gradients 4, Adam 8 bytes, DDP's gradient buckets 4 more;
Psi_frozen = text encoder(s) + VAE, which distlab keeps whole beside the strategy on every rank.)
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

GIB = 2**30
LORA_RANK = 4

SD15_UNET = {"attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768,
             "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], "in_channels": 4,
             "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
             "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3}
SDXL_UNET = {"addition_embed_type": "text_time", "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
             "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "in_channels": 4,
             "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 4,
             "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
             "transformer_layers_per_block": [1, 2, 10],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "use_linear_projection": True}
FLUX_TRANSFORMER = {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
                    "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
                    "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]}
SD_VAE = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
          "up_block_types": ["UpDecoderBlock2D"] * 4, "latent_channels": 4, "layers_per_block": 2,
          "norm_num_groups": 32, "in_channels": 3, "out_channels": 3}
FLUX_VAE = {**SD_VAE, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 768}
CLIP_BIGG = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
             "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu"}
T5_XXL = {"d_model": 4096, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "d_kv": 64, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu"}

# name -> denoiser class and config, frozen parts, resolution (px), roadmap row
MODELS = {
    "Stable Diffusion 1.5": {"class": "UNet2DConditionModel", "config": SD15_UNET, "resolution": 512,
                             "frozen": [("CLIPTextModel", CLIP_L), ("AutoencoderKL", SD_VAE)],
                             "roadmap": "Stable Diffusion: low difficulty, xformers + data parallel is enough"},
    "SDXL": {"class": "UNet2DConditionModel", "config": SDXL_UNET, "resolution": 1024,
             "frozen": [("CLIPTextModel", CLIP_L), ("CLIPTextModelWithProjection", CLIP_BIGG),
                        ("AutoencoderKL", SD_VAE)],
             "roadmap": "Stable Diffusion: low difficulty, xformers + data parallel is enough"},
    "FLUX.1": {"class": "FluxTransformer2DModel", "config": FLUX_TRANSFORMER, "resolution": 1024,
               "frozen": [("CLIPTextModel", CLIP_L), ("T5EncoderModel", T5_XXL), ("AutoencoderKL", FLUX_VAE)],
               "roadmap": "FLUX: medium, may need model parallel"},
}


def _meta_module(class_name: str, config: dict):
    import diffusers
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        if hasattr(diffusers, class_name):
            return getattr(diffusers, class_name).from_config(config)
        config_class = transformers.T5Config if class_name.startswith("T5") else transformers.CLIPTextConfig
        module = getattr(transformers, class_name)(config_class(**config))
    module.tie_weights()  # T5's encoder embedding is its shared embedding: counted once
    return module


@contextlib.contextmanager
def memory_efficient_attention():
    """scaled_dot_product_attention as a fused kernel keeps it for backward: q, k, v, output,
    log-sum-exp (the output values do not matter here: meta tensors)."""
    import torch
    import torch.nn.functional as F

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            out = query.new_empty((*query.shape[:-1], value.shape[-1]))
            ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
            return out

        @staticmethod
        def backward(ctx, grad):  # never run: the measurement stops after forward
            query, key, value, _, _ = ctx.saved_tensors
            return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda query, key, value, *args, **kwargs: FusedAttention.apply(query, key, value)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def step_inputs(class_name: str, config: dict, resolution: int, latent_factor: int = 8) -> dict:
    """Micro-batch 1 of the denoiser's training inputs at `resolution` (latents 1/latent_factor of it:
    8 for the VAEs of SD, SDXL and FLUX)."""
    import torch

    bf = {"device": "meta", "dtype": torch.bfloat16}
    side = resolution // latent_factor
    if class_name == "FluxTransformer2DModel":
        tokens = (side // 2) ** 2  # 2x2 latent patches packed into 64 channels
        return {"hidden_states": torch.zeros(1, tokens, config["in_channels"], **bf),
                "encoder_hidden_states": torch.zeros(1, 512, config["joint_attention_dim"], **bf),
                "pooled_projections": torch.zeros(1, config["pooled_projection_dim"], **bf),
                "timestep": torch.zeros(1, **bf), "img_ids": torch.zeros(tokens, 3, **bf),
                "txt_ids": torch.zeros(512, 3, **bf), "guidance": torch.zeros(1, **bf)}
    inputs = {"sample": torch.zeros(1, config.get("in_channels", 4), side, side, **bf),
              "timestep": torch.zeros(1, device="meta", dtype=torch.long),
              "encoder_hidden_states": torch.zeros(1, 77, config["cross_attention_dim"], **bf)}
    if config.get("addition_embed_type") == "text_time":
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        inputs["added_cond_kwargs"] = {"text_embeds": torch.zeros(1, pooled, **bf), "time_ids": torch.zeros(1, 6, **bf)}
    return inputs


def activation_bytes(model, inputs: dict) -> int:
    """Bytes autograd saves for backward in one forward (parameters and their views excluded)."""
    import torch

    params = {id(p) for p in model.parameters()}
    total = 0

    def pack(tensor):
        nonlocal total
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) not in params and id(base) not in params:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with memory_efficient_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, return_dict=False)
    return total


def size_model(name: str, entry: dict) -> dict:
    import torch
    from peft import LoraConfig

    denoiser = _meta_module(entry["class"], entry["config"]).to(torch.bfloat16)
    params = sum(p.numel() for p in denoiser.parameters())
    denoiser.requires_grad_(False)
    denoiser.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
                                    target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    lora = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    frozen = {cls: sum(p.numel() for p in _meta_module(cls, cfg).parameters()) for cls, cfg in entry["frozen"]}
    try:
        inputs = step_inputs(entry["class"], entry["config"], entry["resolution"], entry.get("latent_factor", 8))
        activations, how = activation_bytes(denoiser, inputs), "measured on meta"
    except Exception as exc:  # a forward this meta probe cannot run: said, and left out of the total
        activations, how = 0, f"not measured: {type(exc).__name__}: {exc}"[:300]
    return {"model": name, "denoiser": entry["class"], "denoiser_params": params, "lora_params": lora,
            "frozen_params": frozen, "resolution": entry["resolution"], "activation_bytes": activations,
            "activations_how": how, "roadmap": entry["roadmap"]}


def per_device(row: dict, n: int, budget: float) -> dict:
    frozen = 2 * sum(row["frozen_params"].values())
    ddp = 2 * row["denoiser_params"] + frozen + 20 * row["lora_params"] + row["activation_bytes"]
    sharded = 2 * row["denoiser_params"] / n + frozen + 16 * row["lora_params"] / n + row["activation_bytes"]
    if ddp <= budget:
        pick = "data parallel (DDP / Accelerate): the whole LoRA training state fits one device"
    elif sharded <= budget:
        pick = f"model sharding over {n} devices (ZeRO-3 / FSDP of the denoiser)"
    else:
        pick = ("does not fit even sharded: gradient checkpointing, CPU offload, a smaller resolution, or more "
                "devices")
    return {**row, "ddp_bytes": ddp, "sharded_bytes": sharded, "devices": n, "recommendation": pick}


def configured_model(folder: str, resolution: int) -> dict:
    """The text_to_image model folder's own configs, in the MODELS entry form."""
    root = Path(folder)
    unet = json.loads((root / "unet" / "config.json").read_text())
    text = json.loads((root / "text_encoder" / "config.json").read_text())
    vae = json.loads((root / "vae" / "config.json").read_text())
    return {"class": "UNet2DConditionModel", "config": unet, "resolution": resolution,
            "latent_factor": 2 ** (len(vae["block_out_channels"]) - 1),
            "frozen": [("CLIPTextModel", {k: v for k, v in text.items() if not k.startswith("_") and k not in (
                       "architectures", "transformers_version", "dtype", "torch_dtype")}),
                       ("AutoencoderKL", vae)],
            "roadmap": "Stable Diffusion: low difficulty, xformers + data parallel is enough"}


def advise_text_to_image(hardware: dict, advisor_cfg: dict, model_folder: str, resolution: int,
                         cpu_ranks: int = 1) -> dict:
    """advice-sd.json: every sized model's per-device memory and the roadmap's answer."""
    from distlab.tools.advisor import plan_devices

    plan = plan_devices(hardware, advisor_cfg, cpu_ranks)
    budget = plan["smallest_bytes"] * (1 - advisor_cfg.get("headroom", 0.1))
    entries = {**MODELS, f"configured ({Path(model_folder).name})": configured_model(model_folder, resolution)}
    rows = [per_device(size_model(name, entry), plan["devices"], budget) for name, entry in entries.items()]
    return {"schema_version": 1, "devices": plan, "usable_bytes_per_device": budget, "models": rows,
            "how": __doc__.split("\n\n", 1)[1].strip()}
