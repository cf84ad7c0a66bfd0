"""The global gradient norm and clipping to it, the same number under every strategy.

The norm is the L2 norm of all of the model's trainable gradients as one vector, wherever
they live: whole on every rank after DDP's all-reduce, DTensor shards under FSDP2 and tensor
parallel (torch reduces a DTensor norm over its mesh; TP's replicated pieces are counted once),
disjoint stages under pipeline parallel (squared norms summed over the stages). Clipping
scales every gradient by max_norm / (norm + 1e-6) when that is below 1, as
torch.nn.utils.clip_grad_norm_ (and DeepSpeed's gradient_clipping, for its own engine) do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def global_grad_norm(parameters, across_stages=None) -> torch.Tensor:
    """Pre-clip global L2 norm (an fp32 scalar tensor, the same on every rank).

    across_stages: the process group whose ranks hold disjoint parameters (pipeline stages);
    None where every rank's gradients already cover the whole model (or DTensors say how)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    parts = []
    if sharded:  # torch cannot mix DTensor and plain tensors in one norm: two partial norms
        norm = get_total_norm(sharded)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if whole:
        parts.append(get_total_norm(whole))
    device = grads[0].device if grads else torch.device("cpu")
    total = get_total_norm(parts).float() if parts else torch.zeros((), device=device)
    if across_stages is not None:
        squared = total.to(torch.float64) ** 2
        dist.all_reduce(squared, group=across_stages)
        total = squared.sqrt().float()
    return total


def clip_to(parameters, max_norm: float, across_stages=None) -> torch.Tensor:
    """Clip to max_norm (0 = only measure); returns the pre-clip global norm."""
    parameters = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(parameters, across_stages)
    if max_norm > 0:
        # torch scales DTensor gradients only by a DTensor: one (replicated) norm per mesh.
        meshes: dict = {}
        for p in parameters:
            meshes.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        for mesh, group in meshes.items():
            clip_grads_with_norm_(group, max_norm, total if mesh is None else DTensor.from_local(total, mesh))
    return total
