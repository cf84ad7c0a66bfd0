"""DDP's settings: none of its own. Its memory formula (every rank holds everything) is the
data-parallel one Accelerate shares."""
from __future__ import annotations

from distlab.configuration.precision import frozen_base_precision
from distlab.configuration.strategies.settings import StrategySettings, state


def replicated_state(counts: dict, lora: bool, precision: str, buckets: bool) -> dict:
    """Every rank holds the whole model: autocast over fp32 weights (LoRA's frozen base in bf16
    when precision is bf16, distlab.configuration.precision.frozen_base_precision; QLoRA's `quantized`
    base weights at half a byte each, its other base weights fp32: distlab.runtime.qlora),
    gradients plus DDP's flat gradient buckets (a second copy) when `buckets`, AdamW's two fp32
    moments."""
    psi = counts["total"]
    t = counts["trainable"] if lora else psi
    quantized = counts.get("quantized", 0)
    frozen_bytes = 4 if quantized else \
        2 if frozen_base_precision("lora" if lora else "full", precision) == "bf16" else 4
    return state({"params": frozen_bytes * (psi - t - quantized) + 0.5 * quantized + 4 * t,
                  "grads": 4 * t + (4 * t if buckets else 0.0),
                  "optimizer": 8 * t})


class DDPSettings(StrategySettings):
    name = "ddp"
    ray_train = True
    advisor_rows = {"ddp": {}}

    def advisor_row(self, spec):
        return "ddp"

    def model_state(self, counts, n, precision, lora, settings):
        return replicated_state(counts, lora, precision, buckets=True)


SETTINGS = DDPSettings()
