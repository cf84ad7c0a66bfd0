"""Strategies: the strategy `<name>` is the `STRATEGY` class of distlab/strategies/<name>.py,
imported only when a run asks for it (parsing the Snakefile never imports torch or
DeepSpeed), with its settings beside it in distlab/strategies/<name>_settings.py (torch-free:
the config layer reads them, distlab/strategies/settings.py). The settings files are the list
of strategies: a rank finds its class without reading config/schema.yaml, and both schemas'
strategy enums are filled from it (distlab.configuration.axes; ARCHITECTURE.md, how to add a
strategy)."""
from __future__ import annotations

from distlab.records.spec import Spec
from distlab.registry import load
from distlab.strategies.settings import registered


def strategy_names() -> list[str]:
    """Every strategy with a settings file, by name."""
    return list(registered())


def strategy_key(spec: Spec) -> str:
    """Which module runs a spec: FSDP requested through Accelerate is Accelerate's to run."""
    settings = registered().get(spec.strategy)
    return settings.runs_as(spec) if settings else spec.strategy


def strategy_for(spec: Spec):
    return get_strategy_class(strategy_key(spec))


def get_strategy_class(name: str):
    return load({known: f"distlab.strategies.{known}:STRATEGY" for known in strategy_names()}, name, "strategy")
