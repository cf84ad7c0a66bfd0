"""Strategies: the strategy `<name>` is the `STRATEGY` class of distlab/strategies/<name>.py,
imported only when a run asks for it (parsing the Snakefile never imports torch or
DeepSpeed). Its torch-free settings are declared a layer down, in
distlab/configuration/strategies/<name>_settings.py (the config layer reads them): those files
are the list of strategies, so a rank finds its class without reading config/schema.yaml, and
both schemas' strategy enums are filled from them (distlab.configuration.axes; ARCHITECTURE.md,
how to add a strategy)."""
from __future__ import annotations

from distlab.configuration.strategies.settings import strategy_key, strategy_names
from distlab.records.spec import SpecFields
from distlab.registry import load


def strategy_for(spec: SpecFields):
    return get_strategy_class(strategy_key(spec))


def get_strategy_class(name: str):
    return load({known: f"distlab.strategies.{known}:STRATEGY" for known in strategy_names()}, name, "strategy")
