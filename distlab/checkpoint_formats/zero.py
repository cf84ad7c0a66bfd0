"""DeepSpeed's own checkpoint layout: every rank writes its ZeRO partitions of the model and
optimizer (engine.save_checkpoint, tag `final`, plus `latest`), frozen parameters left out
(LoRA's base: the checkpoint names it by identity, distlab.checkpoints.checkpoint)."""
from __future__ import annotations

import torch.distributed as dist

from distlab.checkpoint_formats import read_format, write_format

ZERO_FORMAT = "deepspeed"
TAG = "final"


def zero_save(strategy, path: str) -> None:
    """Every rank writes its partitions through the engine; rank 0 then names the format."""
    engine = strategy.model
    engine.save_checkpoint(path, tag=TAG, exclude_frozen_parameters=True)
    dist.barrier()
    if dist.get_rank() == 0:
        write_format(path, {"format": ZERO_FORMAT, "strategy": strategy.name, "tag": TAG,
                            "zero_stage": int(engine.zero_optimization_stage()), "world_size": dist.get_world_size(),
                            "frozen_parameters_saved": False})
    dist.barrier()


def zero_load(strategy, path: str) -> None:
    """Load a zero_save folder at the world size it was written at (ZeRO 1-3 partitions are per rank)."""
    saved = read_format(path)
    if saved["zero_stage"] >= 1 and saved["world_size"] != dist.get_world_size():
        # DeepSpeed refuses too (ZeRORuntimeException); say so before any rank loads.
        raise NotImplementedError(
            f"a native ZeRO-{saved['zero_stage']} checkpoint holds optimizer partitions of "
            f"{saved['world_size']} ranks; DeepSpeed loads it only at that world size (resharding needs "
            "its universal-checkpoint conversion, not wired up here)")
    # LoRA: the checkpoint holds no frozen weight (they keep the base's values): not strict.
    frozen = any(not p.requires_grad for p in strategy.unwrapped().parameters())
    load_path, _ = strategy.model.load_checkpoint(path, tag=TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True, load_module_strict=not frozen)
    if load_path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint (tag '{TAG}') under {path}")
