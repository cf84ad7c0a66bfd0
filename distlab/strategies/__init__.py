"""Strategy registry: name -> "module:Class", imported only when a run asks for it."""
from __future__ import annotations

from distlab.registry import load

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
    return load(REGISTRY, name, "strategy")
