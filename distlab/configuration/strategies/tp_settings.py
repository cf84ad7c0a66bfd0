"""Tensor parallel's settings: none of its own; its refusals (full fine-tuning only, a degree
that divides the attention heads, a model family with a usable tp plan, no diffusers UNet) and
memory formula."""
from __future__ import annotations

import math

from distlab.configuration.families import TP_STYLES, layer_tp_plan
from distlab.configuration.strategies.settings import ModelParallelSettings, state


class TPSettings(ModelParallelSettings):
    name = "tp"
    needs_of_task = {"tensor_parallel_plan": "tensor parallel splits layers by a transformers base_model_tp_plan"}

    def parameter_layout(self, spec):
        return "dtensor"

    def check_shape(self, spec, fail, shape):
        heads = shape.get("num_attention_heads")
        kv_heads = shape.get("num_key_value_heads", heads)
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % spec.world_size:
                fail("world_size", f"tensor parallel degree {spec.world_size} does not divide the model's "
                     f"{name} ({count})")

    def family_refusal(self, model_config, world_size):
        """The family's decoder layers need a tp plan (config.base_model_tp_plan) in styles
        torch's parallel styles express, and heads the degree divides."""
        plan = layer_tp_plan(model_config)
        if not plan:
            return ("it declares no tensor-parallel plan for its decoder layers (config.base_model_tp_plan is "
                    "empty), so nothing says which linear layers to split; use ddp, fsdp or deepspeed")
        unsupported = sorted({style for style in plan.values() if style not in TP_STYLES})
        if unsupported:
            return (f"its tp plan uses style(s) {unsupported} that torch's tensor-parallel styles do not express "
                    f"(supported: {sorted(TP_STYLES)})")
        for name in ("num_attention_heads", "num_key_value_heads"):
            count = getattr(model_config, name, None)
            if count is not None and count % world_size:
                return f"tensor parallel degree {world_size} does not divide the model's {name} ({count})"
        return None

    def model_state(self, counts, n, precision, lora, settings):
        """Full fine-tuning only (strategies.tp); the split linears are sharded, the rest
        (embedding, head, norms) replicated; rank 0 holds the larger piece of an uneven split."""
        split = counts.get("_tp_split")
        if split is None:
            return None
        whole = sum(math.prod(shape) for shape, _ in split)
        local = sum(math.ceil(shape[dim] / n) * (math.prod(shape) // shape[dim]) for shape, dim in split)
        mine = counts["total"] - whole + local
        return state({"params": 4 * mine, "grads": 4 * mine, "optimizer": 8 * mine})


SETTINGS = TPSettings()
