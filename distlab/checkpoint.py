"""Checkpoint formats shared by strategies whose every rank holds the whole model.

Safe to load from a shared results folder: weights are safetensors, optimizer state is
read with torch.load(weights_only=True); nothing arbitrary is unpickled. Writes are
atomic: a temporary folder, fsync, then rename.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())


def atomic_dir(final: str | os.PathLike):
    """A temporary sibling folder to write into; commit() fsyncs and renames it."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    def commit():
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)

    return tmp, commit


def save_plain(strategy, path: str) -> None:
    """Rank 0 writes the model (safetensors) and the optimizer state; others wait."""
    from safetensors.torch import save_model

    if dist.get_rank() == 0:
        tmp, commit = atomic_dir(path)
        save_model(strategy.unwrapped(), str(tmp / "model.safetensors"))
        torch.save(strategy.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "format.json").write_text(json.dumps({"format": "plain", "strategy": strategy.name}))
        commit()
    dist.barrier()


def load_plain(strategy, path: str) -> None:
    from safetensors.torch import load_model

    path = Path(path)
    load_model(strategy.unwrapped(), str(path / "model.safetensors"))
    state = torch.load(path / "optimizer.pt", weights_only=True)
    strategy.optimizer.load_state_dict(state)
