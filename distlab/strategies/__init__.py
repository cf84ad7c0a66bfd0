"""Strategies: the strategy `<name>` is the `STRATEGY` class of distlab/strategies/<name>.py,
imported only when a run asks for it (parsing the Snakefile never imports torch or
DeepSpeed). config/schema.yaml's strategy enum is the list of names a config may use, so a
new strategy is its module, its name in that enum, and a report card (ARCHITECTURE.md)."""
from __future__ import annotations

from distlab.registry import load


def strategy_names() -> list[str]:
    """The strategy enum of config/schema.yaml."""
    from distlab.config import load_schema

    return list(load_schema()["$defs"]["experiment"]["properties"]["strategy"]["enum"])


def strategy_key(spec: dict) -> str:
    """Which module runs a spec: FSDP requested through Accelerate is Accelerate's to run."""
    if spec["strategy"] == "fsdp" and spec.get("fsdp", {}).get("via") == "accelerate":
        return "accelerate"
    return spec["strategy"]


def strategy_for(spec: dict):
    return get_strategy_class(strategy_key(spec))


def get_strategy_class(name: str):
    return load({known: f"distlab.strategies.{known}:STRATEGY" for known in strategy_names()}, name, "strategy")
