"""Which glibc mmap threshold a CPU rank runs under, decided from the model it trains.

glibc's malloc raises its mmap threshold (up to 32 MB) after the first large free, so the
layers FSDP/ZeRO-3 gather and free again (4-12 MB each at 309M), and the layers the final save
streams, come from the heap and stay in RSS after they are freed: a rank then shows more of
the model resident than it holds (measured at 309M under the dynamic threshold: full ZeRO-3
w2's rank 0 above one DDP rank, FSDP over a budget it fits, DDP w2's save phase +1.1 GiB;
benchmarks/RESULTS.md). A fixed threshold (mallopt M_MMAP_THRESHOLD) gives every allocation at or above it
its own mapping, returned to the OS on free, so RSS shows what the rank holds.

That fix has a price on every step: each activation at or above the threshold (the logits, a
wide MLP's output) is a fresh mapping the kernel zero-fills, where the dynamic threshold reuses
heap memory (the default model's 1-rank step: 1.09x Trainer's at 2 MiB, 0.93x dynamic;
benchmarks/trainer_parity.py, benchmarks/RESULTS.md). And it buys nothing for a model whose layers are all
under it: their gathered and streamed copies come from the heap either way. So the threshold is
fixed where a decoder layer holds a weight at or above it, and left to glibc otherwise; the
choice and its reason are recorded in every rank's memory record.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

# At or above it, a tensor gets its own mapping. 2 MiB, not 1: the 309M figures are the same at
# both (within 0.3%), while 1 MiB activations (8 x 128 tokens x 256 fp32) stay in the heap.
HOST_MMAP_THRESHOLD = 2 << 20
# A weight of a repeated block (`model.layers.3.mlp.up_proj.weight`, `h.0.attn.c_attn.weight`,
# `down_blocks.1.resnets.0.conv1.weight`): what sharded strategies gather and the save streams
# one block at a time. Embeddings and the LM head are one-off tensors, gathered once per step.
LAYER_WEIGHT = re.compile(r"\.\d+\.")
FP32_BYTES = 4  # sized as fp32, the widest a CPU rank holds a weight in: when in doubt, fixed

_CHOICE: dict | None = None


def largest_layer_weight_bytes(model_source: str | None) -> int | None:
    """The largest weight of a repeated block in the model folder's safetensors files (their
    headers, no tensor read), as fp32 bytes; None when the folder has no such file to read."""
    from distlab.errors import ConfigError
    from distlab.configuration.model_files import safetensors_header

    folder = Path(model_source) if model_source else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*/*.safetensors"))  # diffusers: unet/, vae/
    sizes = []
    for path in files:
        try:
            header = safetensors_header(path, "model")
        except (OSError, ConfigError):
            return None
        sizes += [math.prod(shape) * FP32_BYTES for name, (_, shape) in header.items() if LAYER_WEIGHT.search(name)]
    return max(sizes) if sizes else None


def choose(model_source: str | None) -> dict:
    """The threshold this rank runs under (None: glibc's dynamic one) and why."""
    forced = os.environ.get("DISTLAB_MMAP_THRESHOLD")
    if forced is not None:  # benchmarks/trainer_parity.py's arms, a user's own choice
        return {"mmap_threshold_bytes": int(forced) or None, "why": "DISTLAB_MMAP_THRESHOLD set"}
    largest = largest_layer_weight_bytes(model_source)
    if largest is None:
        return {"mmap_threshold_bytes": HOST_MMAP_THRESHOLD, "largest_layer_weight_bytes": None,
                "why": "no weight file to size the model's layers from: fixed, so freed gathered layers leave RSS"}
    if largest >= HOST_MMAP_THRESHOLD:
        return {"mmap_threshold_bytes": HOST_MMAP_THRESHOLD, "largest_layer_weight_bytes": largest,
                "why": "a layer weight reaches the threshold: fixed, so freed gathered and streamed layers leave RSS"}
    return {"mmap_threshold_bytes": None, "largest_layer_weight_bytes": largest,
            "why": "every layer weight is under the threshold, so gathered layers come from the heap either way: "
                   "glibc's dynamic threshold, which keeps large activations in the heap (faster steps)"}


def apply(model_source: str | None) -> dict:
    """Set this process's threshold (mallopt M_MMAP_THRESHOLD) as `choose` says; returns the
    record, `applied` False where libc refused."""
    import ctypes
    import ctypes.util

    global _CHOICE
    choice = choose(model_source)
    threshold = choice["mmap_threshold_bytes"]
    applied = threshold is None
    if threshold is not None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            applied = bool(libc.mallopt(-3, threshold))  # -3: M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            applied = False
    _CHOICE = dict(choice, applied=applied,
                   how="glibc mallopt(M_MMAP_THRESHOLD) at rank start (distlab.runtime.host_allocator)")
    return _CHOICE


def record() -> dict | None:
    """What `apply` chose in this process (None: not a CPU rank, or not applied)."""
    return _CHOICE
