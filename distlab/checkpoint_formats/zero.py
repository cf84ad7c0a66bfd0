"""DeepSpeed's own checkpoint layout: every rank writes its ZeRO partitions of the model and
optimizer (engine.save_checkpoint, tag `final`, plus `latest`), frozen parameters left out
(LoRA's base: the checkpoint names it by identity, distlab.checkpoints.checkpoint)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch.distributed as dist

from distlab.checkpoint_formats import read_format, write_format

ZERO_FORMAT = "deepspeed"
TAG = "final"


def zero_save(strategy, path: str) -> None:
    """Every rank writes its partitions through the engine; rank 0 then names the format.
    Collective: DeepSpeed's save has barriers of its own after the writes, so a write that
    raised would leave this rank out of them; the engine's writes are made to keep their
    error (deferred_write_errors) and every rank reaches every barrier, then they agree."""
    from distlab.checkpoints.checkpoint import on_every_rank

    engine = strategy.model
    with deferred_write_errors(engine) as write_errors:
        # `latest` is written below with the format file: DeepSpeed writes it with a bare open().
        engine.save_checkpoint(path, tag=TAG, exclude_frozen_parameters=True, save_latest=False)

    def raise_write_error():
        if write_errors:
            raise write_errors[0]

    on_every_rank(raise_write_error, "DeepSpeed's checkpoint write")

    def name_format():
        write_format(path, {"format": ZERO_FORMAT, "strategy": strategy.name, "tag": TAG,
                            "zero_stage": int(engine.zero_optimization_stage()), "world_size": dist.get_world_size(),
                            "frozen_parameters_saved": False})
        (Path(path) / "latest").write_text(TAG)  # what DeepSpeed's save_latest writes

    on_every_rank(name_format if dist.get_rank() == 0 else None, "the format file (rank 0)")


@contextlib.contextmanager
def deferred_write_errors(engine):
    """While DeepSpeed saves, its checkpoint engine's file writes (save, makedirs) keep their
    exception in the yielded list instead of raising it mid-save, where it would skip the
    barriers the save makes after them (the other ranks would wait there for the job's timeout)."""
    writer = engine.checkpoint_engine
    errors: list[BaseException] = []
    names = [name for name in ("save", "makedirs") if hasattr(writer, name)]
    own = {name: vars(writer)[name] for name in names if name in vars(writer)}  # set on the object itself

    def deferring(original):
        def call(*args, **kwargs):
            if errors:  # the save is already failed: write nothing more
                return None
            try:
                return original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - raised after the save, on every rank (zero_save)
                errors.append(exc)
                return None
        return call

    for name in names:
        setattr(writer, name, deferring(getattr(writer, name)))
    try:
        yield errors
    finally:
        for name in names:
            if name in own:
                setattr(writer, name, own[name])
            else:
                delattr(writer, name)


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
