"""Formulas and counters behind every figure the pipeline prints."""
from __future__ import annotations

import os
import platform
import statistics

METRICS_SCHEMA_VERSION = 1


def flops_per_token(n_params: int, n_embedding: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B / torchtitan `get_num_flop_per_token`:
    6*(N - N_embedding) for the matmuls of forward+backward, plus 12*L*H*Dh*S for attention.
    """
    return 6 * (n_params - n_embedding) + 12 * n_layers * n_heads * head_dim * seq_len


def model_flops_per_token(model, seq_len: int) -> dict:
    config = model.config
    # ds_numel: a ZeRO-3 parameter partitioned at load (deepspeed.zero.Init) has numel() 0.
    n_params = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    n_embedding = getattr(embedding, "ds_numel", None) or embedding.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    value = flops_per_token(n_params, n_embedding, config.num_hidden_layers, heads, head_dim, seq_len)
    return {"flops_per_token": value, "n_params": n_params, "n_embedding": n_embedding,
            "formula": "6*(N - N_embedding) + 12*L*H*Dh*S (PaLM / torchtitan)"}


def mfu(flops_per_tok: float, tokens_per_s: float, peak_flops: float | None) -> float | None:
    if not peak_flops:
        return None
    return flops_per_tok * tokens_per_s / peak_flops


def summarize(values: list[float]) -> dict:
    """Median and spread (min, max, interquartile range) of a list of timings."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "p25": None, "p75": None}
    ordered = sorted(values)
    if len(ordered) >= 2:
        q = statistics.quantiles(ordered, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = ordered[0]
    return {"n": len(ordered), "median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "p25": p25, "p75": p75}


def _storage_key(tensor):
    try:
        return tensor.untyped_storage().data_ptr(), tensor.device.type
    except Exception:  # meta or exotic tensors
        return id(tensor), "other"


def _local(tensor):
    """The shard this rank holds (DTensor -> its local tensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and ties counted once)."""
    seen = {}
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = _local(tensor)
        key = _storage_key(tensor)
        size = tensor.untyped_storage().nbytes() if key[1] != "other" else tensor.numel() * tensor.element_size()
        seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values())


def model_state_bytes(model, optimizer) -> dict:
    """Params, grads and optimizer state this rank actually holds, counted from its tensors."""
    import torch

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt_tensors),
            "how": "distinct tensor storages held by this rank (DTensor: local shard)"}


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def allowed_environment(allowlist: list[str]) -> dict:
    """Only allow-listed variables: results folders get shared, secrets must never land there."""
    return {name: os.environ[name] for name in allowlist if name in os.environ}


def library_versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "ray", "datasets", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
