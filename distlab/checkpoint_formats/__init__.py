"""The native checkpoint formats: how each strategy's ranks write and read the `state/` folder
of a checkpoint (distlab.checkpoints.checkpoint lays out the rest of the folder and makes it atomic).

- `plain`: rank 0 writes the trainable parameters (safetensors) and the optimizer; every rank
  reads the same files (DDP: each rank holds the whole model).
- `dcp`: torch.distributed.checkpoint, each rank writing its own shards (FSDP2, tensor and
  pipeline parallel: ranks hold different pieces).
- `zero`: DeepSpeed's own per-rank ZeRO partitions (engine.save_checkpoint).
Accelerate's is accelerator.save_state itself, with a pre-hook bound to its strategy that drops
frozen parameters: it stays in distlab/strategies/accelerate.py.

Every format writes a `format.json` naming itself and the strategy that wrote it (write_format);
a loader checks it first (read_format). No torch at import time.
"""
from __future__ import annotations

import json
from pathlib import Path

FORMAT_FILE = "format.json"


def write_format(folder, fields: dict) -> None:
    """format.json in `folder`: {"format": ..., "strategy": ..., ...} (rank 0 writes it)."""
    (Path(folder) / FORMAT_FILE).write_text(json.dumps(fields))


def read_format(folder, expected: str | None = None) -> dict:
    """The folder's format.json; ValueError naming the folder when it is not `expected`."""
    fmt = json.loads((Path(folder) / FORMAT_FILE).read_text())
    if expected is not None and fmt.get("format") != expected:
        raise ValueError(f"{folder}: checkpoint format {fmt.get('format')!r}, expected {expected!r}")
    return fmt


def trainable_names(module) -> set[str]:
    """Names of the parameters the optimizer steps (LoRA: the adapters): what a native
    checkpoint holds."""
    return {name for name, param in module.named_parameters() if param.requires_grad}
