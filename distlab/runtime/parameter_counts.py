"""Parameter counts of a model from its config.json alone (no weights): totals, per decoder
layer, LoRA-trainable, each parameter's shape (for sharding padding) and what tensor
parallel splits. Exact for every family: the model is instantiated on the meta device (no
memory) and its parameters summed. Used by the advisor and by strategies that size buffers
from the model (ZeRO-3's live-parameter limits).
"""
from __future__ import annotations

import copy
import functools
import json


def model_shape(config_json: dict) -> dict:
    """The numbers the estimates need, read through transformers.AutoConfig (so GPT-2's
    n_embd/n_layer, GPT-NeoX's names, tied embeddings all mean what the model means)."""
    from transformers import AutoConfig

    if "model_type" not in config_json:
        raise ValueError("model config.json has no 'model_type': transformers.AutoConfig cannot tell the family")
    try:
        config = AutoConfig.for_model(**config_json)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model config.json: transformers.AutoConfig refuses it ({exc})") from None
    hidden, heads = config.hidden_size, config.num_attention_heads
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                    or 4 * hidden)
    return {"model_type": config.model_type, "hidden_size": hidden, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or hidden // heads,
            "intermediate_size": intermediate, "vocab_size": config.vocab_size,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
            "config_json": dict(config_json)}


def workload_counts(shape: dict, workload: dict) -> dict:
    """parameter_counts for a spec or advisor workload: LoRA's and QLoRA's adapters trainable;
    QLoRA also counts `quantized`, the base weights bitsandbytes holds in 4 bits (the Linear
    layers of the decoder layers; distlab.runtime.qlora), 0 otherwise."""
    adapters = workload["method"] in ("lora", "qlora")
    counts = parameter_counts(shape, workload["lora"] if adapters else None)
    counts["quantized"] = counts["decoder_linear_weights"] if workload["method"] == "qlora" else 0
    return counts


def parameter_counts(shape: dict, lora: dict | None = None) -> dict:
    """Total, embedding, per-layer and LoRA-trainable counts, exact for every family: the
    model is instantiated on the meta device (no memory) and its parameters summed.
    `_shapes`: each parameter's shape and whether it trains (for sharding padding)."""
    return copy.deepcopy(_parameter_counts(json.dumps(shape["config_json"], sort_keys=True, default=str),
                                           json.dumps(lora, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=32)
def _parameter_counts(config_json: str, lora_json: str) -> dict:
    shape, lora = {"config_json": json.loads(config_json)}, json.loads(lora_json)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distlab.runtime.model import decoder_layers

    config = AutoConfig.for_model(**shape["config_json"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    embedding = model.get_input_embeddings().weight.numel()
    output = model.get_output_embeddings()
    tied = output is None or output.weight is model.get_input_embeddings().weight
    head = 0 if tied else output.weight.numel()
    per_layer = sum(p.numel() for p in decoder_layers(model)[0].parameters())
    # What a 4-bit load quantises: the weight of every nn.Linear inside the decoder layers.
    linear_weights = sum(m.weight.numel() for layer in decoder_layers(model) for m in layer.modules()
                         if isinstance(m, torch.nn.Linear))
    tp_split = _tp_split(model)
    linears = _layer_linears(model)
    trainable = total
    if lora is not None:
        from distlab.runtime.lora import apply_lora

        model, _ = apply_lora(model, lora, seed=0)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
    return {"total": total, "embedding": embedding, "per_layer": per_layer,
            "largest_unit": max(per_layer, embedding, head), "trainable": trainable,
            "layers": len(decoder_layers(model)), "decoder_linear_weights": linear_weights,
            "hidden_size": getattr(config, "hidden_size", None),
            "_shapes": [(tuple(p.shape), p.requires_grad) for p in model.parameters()], "_tp_split": tp_split,
            "_linears": linears}


def _layer_linears(model) -> list[tuple[str, int, int, int | None]]:
    """(name, in_features, out_features, tensor-parallel split dim or None) of each matmul weight
    in one decoder layer (every layer is alike), then ("lm_head", hidden, vocab, None): the
    matmul shapes the step-time model probes (distlab.tools.step_time). GPT-2's Conv1D holds
    its weight as (in, out); nn.Linear as (out, in)."""
    import torch

    from distlab.runtime.model import decoder_layers, layer_plan

    try:
        plan = layer_plan(model)
    except NotImplementedError:
        plan = {}
    out = []
    for name, module in decoder_layers(model)[0].named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif type(module).__name__ == "Conv1D" and weight is not None and weight.dim() == 2:
            fan_in, fan_out = weight.shape
        else:
            continue
        style = plan.get(name)
        out.append((name, int(fan_in), int(fan_out), None if style is None else 0 if style.startswith("colwise")
                    else 1))
    hidden, vocab = model.get_input_embeddings().weight.shape[::-1]
    out.append(("lm_head", int(hidden), int(vocab), None))
    return out


def _tp_split(model) -> list[tuple[tuple, int]] | None:
    """(shape, split dim) of each parameter tensor parallel splits, from the same plan
    distlab.strategies.tp applies (colwise: weight and bias on dim 0; rowwise: weight on dim 1, bias
    whole); None for a model without a usable plan (tensor parallel refused)."""
    from distlab.runtime.model import decoder_layers, layer_plan

    try:
        plan = layer_plan(model)
    except NotImplementedError:
        return None
    out = []
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if name not in plan:
                continue
            colwise = plan[name].startswith("colwise")
            for param_name, param in module.named_parameters(recurse=False):
                if param_name == "weight" or (param_name == "bias" and colwise):
                    out.append((tuple(param.shape), 0 if colwise else 1))
    return out
