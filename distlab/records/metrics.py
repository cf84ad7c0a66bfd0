"""Formulas and counters behind every figure the pipeline prints."""
from __future__ import annotations

import os
import platform
import statistics

METRICS_SCHEMA_VERSION = 1


def flops_per_token(n_params: int, n_embedding: int, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int, n_trainable: int | None = None) -> float:
    """Training FLOPs per token, PaLM appendix B / torchtitan `get_num_flop_per_token`:
    6*(N - N_embedding) for the matmuls of forward+backward, plus 12*L*H*Dh*S for attention.

    With frozen weights (LoRA) only trainable ones need the weight-gradient matmul: forward
    2N + input-gradient 2N + weight-gradient 2*N_trainable, i.e. 4*N_frozen + 6*N_trainable.
    """
    matmul = n_params - n_embedding
    trainable = matmul if n_trainable is None else min(n_trainable, matmul)
    return 4 * (matmul - trainable) + 6 * trainable + 12 * n_layers * n_heads * head_dim * seq_len


def _embedding_tied_to_head(model) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def formula_flops_per_token(model, seq_len: int) -> dict:
    """The formula on the model as trained (LoRA applied). The input embedding is a lookup,
    not a matmul, so it is left out, unless it is tied to the LM head, whose matmul is real."""
    config = model.config
    # ds_numel: a ZeRO-3 parameter partitioned at load (deepspeed.zero.Init) has numel() 0.
    def numel(p):
        return getattr(p, "ds_numel", None) or p.numel()

    n_params = sum(numel(p) for p in model.parameters())  # a tied weight is listed once
    n_trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    tied = _embedding_tied_to_head(model)
    embedding = model.get_input_embeddings().weight
    n_embedding = 0 if tied else numel(embedding)
    if not tied and embedding.requires_grad:
        n_trainable -= numel(embedding)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    value = flops_per_token(n_params, n_embedding, config.num_hidden_layers, heads, head_dim, seq_len,
                            n_trainable=n_trainable)
    return {"formula_per_token": value, "n_params": n_params, "n_trainable": n_trainable,
            "n_embedding_excluded": n_embedding, "tied_embedding": tied,
            "formula": "4*(N - N_emb - N_trainable) + 6*N_trainable + 12*L*H*Dh*S (PaLM / torchtitan; frozen "
                       "weights get no weight-gradient matmul; N_emb = 0 when the embedding is the LM head)"}


def _cpu_attention_flops():
    """torch's flop counter has no entry for SDPA's CPU kernel: count it with torch's own
    SDPA formulas (the same ones it uses for the CUDA kernels)."""
    import torch
    from torch.utils import flop_counter

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def counted_flops_per_token(model, seq_len: int) -> float:
    """FLOPs per token counted by torch.utils.flop_counter.FlopCounterMode over one real
    forward+backward of `model` (micro-batch 1, `seq_len` tokens). Gradients and RNG are left
    as they were, so training is unchanged; a meta-device model is counted on meta tensors."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters())
    device = param.device
    saved_grads = [p.grad for p in model.parameters()]
    ids = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), FlopCounterMode(display=False,
                                                                     custom_mapping=_cpu_attention_flops()) as fc:
        model(input_ids=ids, labels=ids).loss.backward()
    for p, grad in zip(model.parameters(), saved_grads):
        p.grad = grad
    return fc.get_total_flops() / seq_len


def model_flops_per_token(model, seq_len: int, count: bool = True) -> dict:
    """Both ways side by side; MFU uses the counted figure where there is one (named in `mfu_uses`)."""
    out = formula_flops_per_token(model, seq_len)
    counted, how = None, "not counted on this rank"
    if count:
        try:
            counted = counted_flops_per_token(model, seq_len)
            how = (f"torch.utils.flop_counter.FlopCounterMode over one forward+backward of the run's model "
                   f"(LoRA applied, before wrapping) at seq_len {seq_len}, micro-batch 1, on "
                   f"{next(model.parameters()).device.type}; attention counted without the causal discount, "
                   "like the formula")
        except Exception as exc:  # a model this counter cannot run: say so, keep the formula
            how = f"not counted: {type(exc).__name__}: {exc}"
    out.update({"counted_per_token": counted, "how": how,
                "counted_over_formula": counted / out["formula_per_token"] if counted else None,
                "mfu_uses": "counted" if counted else "formula",
                "flops_per_token": counted if counted else out["formula_per_token"]})
    return out


def mfu(flops_per_tok: float | None, tokens_per_s: float, peak_flops: float | None) -> float | None:
    if not peak_flops or flops_per_tok is None:  # no peak known, or FLOPs not counted (the record says why)
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
    out = {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt_tensors),
           "how": "distinct tensor storages held by this rank (DTensor: local shard)"}
    buckets = ddp_bucket_bytes(model)
    if buckets is not None:
        out["grad_buckets"] = buckets
        out["how"] += ("; grad_buckets: DistributedDataParallel's flat gradient buckets (a second copy of the "
                       "gradients unless gradient_as_bucket_view), from its logging data")
    return out


def ddp_bucket_bytes(model) -> int | None:
    """Bytes of DDP's gradient buckets (None: not a DDP model). With gradient_as_bucket_view
    off (the default) the reducer keeps them beside param.grad: the gradients held twice."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    data = model._get_ddp_logging_data()
    if data.get("gradient_as_bucket_view"):
        return 0
    sizes = str(data.get("bucket_sizes") or "")
    return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def allowed_environment(allowlist: list[str]) -> dict:
    """Only allow-listed variables: results folders get shared, secrets must never land there."""
    return {name: os.environ[name] for name in allowlist if name in os.environ}


def library_versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed", "ray", "datasets",
                 "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
