"""LoRA through peft, with targets found from the loaded model rather than Llama names."""
from __future__ import annotations

import torch

from distlab.model import linear_module_names


def apply_lora(model, lora_cfg: dict, seed: int):
    from peft import LoraConfig, get_peft_model

    targets = lora_cfg.get("target_modules") or linear_module_names(model)
    # Same seed on every rank: adapters start identical, as data parallelism requires.
    torch.manual_seed(seed)
    config = LoraConfig(r=lora_cfg["r"], lora_alpha=lora_cfg["alpha"], lora_dropout=lora_cfg["dropout"],
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config), targets


def parameter_counts(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "trainable_fraction": trainable / total if total else 0.0}
