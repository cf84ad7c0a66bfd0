"""LoRA through peft, with targets found from the loaded model rather than Llama names.

Every strategy receives the PeftModel (the base weights frozen, adapters trainable) and
wraps it like any model; `strategy.unwrapped()` hands it back for save_pretrained.
"""
from __future__ import annotations

import torch

from distlab.runtime.model import decoder_layers, linear_module_names


def adaptable_module_names(model) -> list[str]:
    """Leaf names of the layers inside decoder layers that peft's LoRA can adapt: nn.Linear
    (Llama, Mistral, Qwen, ...) and transformers' Conv1D (GPT-2 style models)."""
    names = set(linear_module_names(model))
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always ships it today
        return sorted(names)
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, Conv1D):
                names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def lora_targets(model, requested: list[str] | None) -> list[str]:
    """The requested module names, each checked against the model, or every adaptable layer."""
    found = adaptable_module_names(model)
    if requested is None:
        if not found:
            raise ValueError(f"config field 'lora.target_modules': {type(model).__name__} has no linear layer "
                             "inside its decoder layers to adapt; name the modules explicitly")
        return found
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [name for name in requested if name not in leaves]
    if missing:
        raise ValueError(f"config field 'lora.target_modules': {missing} match no module of "
                         f"{type(model).__name__}; its adaptable layers are {found}")
    return list(requested)


def apply_lora(model, lora_cfg: dict, seed: int):
    """(PeftModel, target names). Only adapter weights train; the base stays bit-identical."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, lora_cfg.get("target_modules"))
    # Same seed on every rank: adapters start identical, as data parallelism requires.
    torch.manual_seed(seed)
    config = LoraConfig(r=lora_cfg["r"], lora_alpha=lora_cfg["alpha"], lora_dropout=lora_cfg["dropout"],
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    stray = [name for name in trainable if "lora_" not in name]
    if not trainable or stray:
        # A base weight left trainable would be silently fine-tuned under a LoRA label.
        raise RuntimeError(f"LoRA left base parameters trainable: {stray[:5]}" if stray
                           else "LoRA produced no trainable parameter")
    return peft_model, targets


def base_name(peft_key: str) -> str | None:
    """The base model's name for a PeftModel state-dict key; None for an adapter weight."""
    if "lora_" in peft_key:
        return None
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def parameter_counts(model) -> dict:
    # ds_numel: a ZeRO-3 parameter partitioned at load (deepspeed.zero.Init) has numel() 0.
    total = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
    trainable = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "trainable_fraction": trainable / total if total else 0.0}
