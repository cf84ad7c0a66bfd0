"""Accelerate's settings: none of its own; `accelerate launch` starts it, and it runs FSDP
requested through it (distlab/strategies/fsdp_settings.py)."""
from __future__ import annotations

from distlab.strategies.ddp_settings import replicated_state
from distlab.strategies.settings import StrategySettings


class AccelerateSettings(StrategySettings):
    name = "accelerate"
    launcher = "accelerate"

    def advisor_row(self, spec):
        return "ddp"

    def model_state(self, counts, n, precision, lora, settings):
        return replicated_state(counts, lora, precision, buckets=n > 1)  # it wraps DDP at 2+ processes only


SETTINGS = AccelerateSettings()
