"""Strategy registry: name -> "module:Class", imported only when a run asks for it."""
from __future__ import annotations

import importlib

REGISTRY = {
    "ddp": "distlab.strategies.ddp:DDPStrategy",
    "accelerate": "distlab.strategies.accelerate:AccelerateStrategy",
    "deepspeed": "distlab.strategies.deepspeed:DeepSpeedStrategy",
    "fsdp": "distlab.strategies.fsdp:FSDPStrategy",
    "tp": "distlab.strategies.tp:TensorParallelStrategy",
    "pp": "distlab.strategies.pp:PipelineParallelStrategy",
}


def strategy_key(spec: dict) -> str:
    """Which module runs a spec: FSDP requested through Accelerate is Accelerate's to run."""
    if spec["strategy"] == "fsdp" and spec.get("fsdp", {}).get("via") == "accelerate":
        return "accelerate"
    return spec["strategy"]


def strategy_for(spec: dict):
    return get_strategy_class(strategy_key(spec))


def get_strategy_class(name: str):
    try:
        target = REGISTRY[name]
    except KeyError:
        raise NotImplementedError(
            f"strategy '{name}' is not implemented in this version of distlab (available: {sorted(REGISTRY)})"
        ) from None
    module, cls = target.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # a missing dependency, not a missing strategy
        raise NotImplementedError(f"strategy '{name}' is not implemented in this version of distlab") from None
