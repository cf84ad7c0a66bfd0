"""Accelerate's settings: none of its own; `accelerate launch` starts it, and it runs FSDP
requested through it (distlab/configuration/strategies/fsdp_settings.py)."""
from __future__ import annotations

from distlab.records.spec import SpecFields
from distlab.configuration.strategies.ddp_settings import replicated_state
from distlab.configuration.strategies.settings import StrategySettings, settings_for

#: The Accelerate config file `accelerate launch` reads, written in the run's run_files folder
#: (distlab.launchers.accelerate) and checked by the strategy against what the ranks got.
CONFIG_NAME = "accelerate_config.yaml"


def uses_accelerate_fsdp(spec: SpecFields) -> bool:
    """FSDP requested through Accelerate (the FSDP settings' accelerate_plugin)."""
    return settings_for(spec).accelerate_plugin(spec) == "FSDP"


class AccelerateSettings(StrategySettings):
    name = "accelerate"
    launcher = "accelerate"

    def advisor_row(self, spec):
        return "ddp"

    def model_state(self, counts, n, precision, lora, settings):
        return replicated_state(counts, lora, precision, buckets=n > 1)  # it wraps DDP at 2+ processes only


SETTINGS = AccelerateSettings()
