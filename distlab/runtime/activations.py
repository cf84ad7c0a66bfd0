"""Activation memory: checkpointing it away, measuring it, estimating it.

Checkpointing is transformers' own (activation_checkpointing_enable, non-reentrant
torch.utils.checkpoint per decoder layer, `every_n_layers` for selective; FSDP2's hooks stay
outside the checkpointed forward). Measured per rank on one micro-batch of the first untimed
step: the bytes autograd holds for backward when that micro-batch's forward ends (every saved
tensor's storage once, parameters left out), read with torch.autograd.graph.saved_tensors_hooks.
Inside a checkpointed layer only its input is saved; backward recomputes one layer at a time,
whose activations come on top of the figure while it runs.
"""
from __future__ import annotations

import contextlib

from distlab.records.spec import Spec
from distlab.configuration.strategies.settings import registered, settings_for

HOW = ("bytes autograd holds for backward at the end of one micro-batch's forward (saved_tensors_hooks; each "
       "storage once, parameters excluded), on rank {rank}'s first micro-batch of step {step} (untimed); pipeline "
       "stages: every pipeline micro-batch of it")


def checkpointed_layers(mode: str, every: int, n_layers: int) -> list[int]:
    """Indices of the decoder layers a mode checkpoints (transformers: layer i when i % k == 0)."""
    if mode == "none":
        return []
    k = 1 if mode == "full" else every
    return [i for i in range(n_layers) if i % k == 0]


def enable_checkpointing(model, spec: Spec) -> None:
    """Turn on the spec's activation checkpointing (a no-op for none). The model must train in
    training mode: transformers' layers checkpoint only when `self.training`."""
    mode = spec.activation_checkpointing
    if mode == "none":
        return
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing {mode}: {type(hf).__name__} does not support it (transformers' "
                         "supports_gradient_checkpointing is False)")
    every = 1 if mode == "full" else spec.activation_checkpointing_every
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(kwargs, every_n_layers=every)
    else:  # transformers releases before every_n_layers: every layer, then keep every k-th
        from distlab.runtime.model import decoder_layers

        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for index, layer in enumerate(decoder_layers(hf)):
            layer.gradient_checkpointing = index % every == 0
    model.train()


def checkpointing_facts(model, spec: Spec) -> dict:
    """What is really checkpointed, read from the layers of the wrapped model: their flags and
    training mode (a layer in eval mode never checkpoints)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    active = [i for i, m in enumerate(layers) if m.gradient_checkpointing and m.training]
    return {"mode": spec.activation_checkpointing, "layers_held": len(layers), "checkpointed": active,
            "how": "GradientCheckpointingLayer flags and training mode of the layers this rank holds"}


def check_checkpointing(facts: dict, spec: Spec) -> str | None:
    """Why the model's checkpointing is not the spec's (None: it is). A pipeline stage holds a
    run of the layers, numbered in the whole model: there only full and none are exact."""
    mode, held, chosen = spec.activation_checkpointing, facts["layers_held"], facts["checkpointed"]
    wanted = checkpointed_layers(mode, spec.activation_checkpointing_every, held)
    if settings_for(spec).holds_layer_run and mode == "selective":
        wrong = len(chosen) > held
    else:
        wrong = chosen != wanted or (mode != "none" and not held)
    if wrong:
        return (f"activation_checkpointing {mode} should checkpoint layers {wanted} of the {held} this rank "
                f"holds; checkpointed (flag set, training mode): {chosen}")
    return None


def _storage_bytes(tensor) -> tuple[int, int]:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class ActivationProbe:
    """micro_context for distlab.rank.loop: measures the saved activation bytes of the first
    micro-batch of the first untimed step, on every rank; `result` holds the figure afterwards.
    A micro-batch's backward saves nothing through these hooks (a checkpointed layer's
    recompute saves through torch's own, inner hooks), so what is packed is its forward's."""

    def __init__(self, spec: Spec, rank: int, start_step: int):
        self.step = start_step if start_step < spec.untimed_steps else None
        self.rank = rank
        self.result = {"bytes": None, "how": "not measured: the run started past its untimed steps (resumed)"}

    def __call__(self, step: int, micro: int):
        if step != self.step or micro != 0:
            return contextlib.nullcontext()
        return self._measure(step)

    @contextlib.contextmanager
    def _measure(self, step: int):
        import torch

        seen: dict[int, int] = {}

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter) and not isinstance(getattr(tensor, "_base", None),
                                                                             torch.nn.Parameter):
                ptr, size = _storage_bytes(tensor)
                if ptr:
                    seen[ptr] = size
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.result = {"bytes": sum(seen.values()), "step": step, "how": HOW.format(rank=self.rank, step=step)}


# Estimated per token, in floats (fp32 training, Llama-style decoder with SDPA): a decoder layer
# keeps 8h + 2*kv + 4i for backward (norm inputs and outputs, q/k/v, attention output, the
# MLP's gate, activation, up and product), the model outside its layers V + 3h (logits, final
# norm); a checkpointed layer keeps only its input, h. Fitted on nine shapes measured with
# ActivationProbe on CPU (hidden 64-256, 2-4 layers, GQA and not, vocab 512-4096): within 2%.
# Low precision, measured on CPU bf16 (hidden 256 and 512): autocast over fp32 weights keeps
# 0.73-0.74x the fp32 bytes plus its bf16 copies of the matmul weights (2 bytes each, held
# for backward too); a module kept in bf16 (DeepSpeed, FSDP's MixedPrecisionPolicy) 0.62-0.63x
# (the norms still compute in fp32).
LOW_PRECISION_FRACTION = {"autocast": 0.74, "module": 0.63}
ESTIMATE_HOW = ("per token: each decoder layer 8h + 2*kv_dim + 4i floats (h if checkpointed), outside the "
                "layers V + 3h; x4 bytes in fp32, x4x0.74 under autocast (plus 2 bytes per matmul weight: its "
                "bf16 copy), x4x0.63 for a module kept in bf16; checkpointing adds one layer's activations while "
                "backward recomputes it (peak). Fitted to saved-tensor measurements of Llama-style models on CPU "
                "(fp32 within 2%)")


def estimate_activations(shape: dict, micro_batch: int, seq_len: int, precision: str, mode: str = "none",
                         every: int = 2, low_precision: str = "autocast", autocast_weights: int = 0) -> dict:
    """Bytes one data-parallel rank holds for backward per micro-batch: `held` (end of forward,
    what ActivationProbe measures) and `peak` (held + the layer backward recomputes).
    low_precision: how a bf16/fp16 run computes ("autocast" over fp32 weights, or a "module"
    kept in low precision); autocast_weights: matmul weights autocast copies for backward."""
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv_dim = shape.get("num_key_value_heads", shape["num_attention_heads"]) * shape.get(
        "head_dim", h // shape["num_attention_heads"])
    layer = 8 * h + 2 * kv_dim + 4 * shape["intermediate_size"]
    checkpointed = len(checkpointed_layers(mode, every, layers))
    floats = (layers - checkpointed) * layer + checkpointed * h + vocab + 3 * h
    tokens = micro_batch * seq_len
    fp32 = precision == "fp32"
    scale = 4.0 if fp32 else 4.0 * LOW_PRECISION_FRACTION[low_precision]
    weights = 2 * autocast_weights if not fp32 and low_precision == "autocast" else 0
    held = tokens * floats * scale + weights
    recompute = tokens * layer * scale if checkpointed else 0
    return {"held_bytes": held, "recompute_bytes": recompute, "peak_bytes": held + recompute,
            "checkpointed_layers": checkpointed, "how": ESTIMATE_HOW}


def activation_bytes(shape: dict, workload: dict, counts: dict, mode: str | None = None, strategy: str = "ddp",
                     part: str = "peak_bytes") -> float:
    """Activation bytes of one micro-batch on a data-parallel rank (estimate_activations) for a
    spec or advisor workload: the advisor's estimate and an unequal rank's auto micro-batch both size by it.
    Autocast over fp32 weights (DDP/Accelerate, FSDP on CPU) also holds bf16 copies of the
    matmul weights (LoRA's frozen base is already bf16); DeepSpeed and FSDP's
    MixedPrecisionPolicy keep the module in bf16 instead."""
    mode = workload.get("activation_checkpointing", "none") if mode is None else mode
    known = registered().get(strategy)
    module = bool(known and known.module_precision(workload))
    matmul = counts["total"] - (0 if shape.get("tie_word_embeddings") else counts["embedding"])
    return estimate_activations(shape, workload["micro_batch"], workload["seq_len"], workload["precision"], mode,
                                workload.get("activation_checkpointing_every", 2),
                                "module" if module else "autocast",
                                matmul if workload["method"] == "full" else 0)[part]
