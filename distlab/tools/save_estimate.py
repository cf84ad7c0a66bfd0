"""The advisor's save-phase estimate: what the final save holds and writes, from the parameter
counts alone, as distlab saves (distlab.checkpoints.checkpoint, distlab.checkpoints.export):

- rank 0's host memory during the export: two streamed groups in fp32 (the largest decoder
  layer, or the embedding or head when larger: the one gathered for the export and, under ZeRO-3,
  one the final forward still holds gathered) plus the recorded logits (EVAL_BATCH x EVAL_TOKENS
  x vocab, fp32); every rank's device holds at most the one parameter (FSDP, tensor parallel) or
  layer (ZeRO-3) being gathered, never more than training's own gathered unit;
- the native checkpoint on disk, all ranks together: the trainable parameters and their AdamW
  state, 4 + 8 bytes each (the frozen base of a LoRA run is named, not saved; ZeRO-3's module
  file holds no weights, its fp32 partitions are the 4); torch.distributed.checkpoint (FSDP,
  tensor and pipeline parallel) adds DCP_ITEM_BYTES per item it stores (each rank's piece of
  each parameter and of its two Adam moments, and one step counter per parameter: a torch.save
  container and a metadata entry each; measured on a 309M LoRA run);
- the export: LoRA's adapter (4 bytes per trainable parameter; + the merged model with
  export.merge), a full fine-tune's whole model, fp32, in ceil(bytes / max_shard_size) files.
Checked against real runs in tests/test_memory_sharded.py (309M model, LoRA and full, DDP, FSDP,
ZeRO-3): checkpoint bytes within TOLERANCE; rank 0's host figure is a bound, not a prediction:
its save-phase peak minus its training-phase peak stays under it (+TOLERANCE). Measured there
(2026-12-03, against the one-unit figure of then): LoRA ZeRO-3 added 0.99x and 1.16x of it
in two runs (the layer gathered for the export on top of the forward's live ones), FSDP 0.31x,
DDP 0.13-0.14x (on CPU the streamed layer is the live
parameter, not a copy; a CUDA run copies it to the host); full fine-tuning's saves peaked
0.6-1.6 GiB below training peaks that held the gradients.
"""
from __future__ import annotations

import math

from distlab.configuration.strategies.settings import registered

TOLERANCE = 0.15  # measured / estimated checkpoint bytes a run may be off by (file headers, trainer state)
DCP_ITEM_BYTES = 4500
# Streamed units rank 0 may hold at once in the save phase: the one gathered for the export and,
# under ZeRO-3, one its final forward still holds gathered (LoRA ZeRO-3 at 309M measured 0.99x
# and 1.16x of a one-unit bound in two runs: one unit was never a bound there).
HELD_UNITS = 2


def shard_bytes(max_shard_size: str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    return parse_size_to_int(max_shard_size)


def save_estimate(counts: dict, vocab_size: int, lora: bool, export: dict | None = None, strategy: str = "ddp",
                  world_size: int = 1) -> dict:
    from distlab.checkpoints.export import DEFAULTS, EVAL_BATCH, EVAL_TOKENS

    export = {**DEFAULTS, **(export or {})}
    trained = counts["trainable"] if lora else counts["total"]
    tensors = sum(1 for _, trains in counts.get("_shapes", []) if trains or not lora)
    known = registered().get(strategy)
    containers = DCP_ITEM_BYTES * tensors * (3 * world_size + 1) if known and known.dcp_checkpoint else 0
    exported = 4 * (counts["trainable"] if lora else counts["total"])
    merged = 4 * counts["total"] if lora and export["merge"] else 0
    whole = counts["total"] * 4
    return {
        "rank0_host_bytes": 4 * HELD_UNITS * counts["largest_unit"] + 4 * EVAL_BATCH * EVAL_TOKENS * vocab_size,
        "native_checkpoint_bytes": 12 * trained + containers,
        "export_bytes": exported + merged,
        "checkpoint_bytes": 12 * trained + containers + exported + merged,
        "export_files": 1 if lora and not merged else max(1, math.ceil(whole / shard_bytes(export["max_shard_size"]))),
        "max_shard_size": export["max_shard_size"],
    }


def save_markdown(estimate: dict, human) -> list[str]:
    """The advice's save-phase lines."""
    return ["", "**Save phase** (final checkpoint and export, streamed one decoder layer at a time): rank 0 holds "
            f"at most {human(estimate['rank0_host_bytes'])} of host memory beyond its training peak (two decoder "
            f"layers in fp32: the one streamed to the export and, under ZeRO-3, one its forward still holds; and "
            f"the recorded logits); each checkpoint writes {human(estimate['native_checkpoint_bytes'])} of "
            f"native state over all ranks, and the final one an export of {human(estimate['export_bytes'])} in "
            f"{estimate['export_files']} safetensors file(s) of at most {estimate['max_shard_size']}."]
