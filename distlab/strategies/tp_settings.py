"""Tensor parallel's settings: none of its own; its refusals (full fine-tuning only, a degree
that divides the attention heads, a model family with a usable tp plan) and memory formula."""
from __future__ import annotations

import math

from distlab.strategies.settings import ModelParallelSettings, state


class TPSettings(ModelParallelSettings):
    name = "tp"

    def parameter_layout(self, spec):
        return "dtensor"

    def check_shape(self, spec, fail, shape):
        heads = shape.get("num_attention_heads")
        kv_heads = shape.get("num_key_value_heads", heads)
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % spec["world_size"]:
                fail("world_size", f"tensor parallel degree {spec['world_size']} does not divide the model's "
                     f"{name} ({count})")

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
