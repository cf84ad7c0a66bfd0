"""Build one rank's model the one way every caller shares (training and checkpoint
validation): the strategy loads it, LoRA is applied, the strategy wraps it, and the result
is checked against the spec.

The strategy's `load_model` decides what this rank materialises (the whole model, a
meta-device skeleton it shards before loading weights, only its pipeline stage, ...);
`wrap` must end with real weights for what this rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from distlab.records.spec import Spec


@dataclass
class PreparedModel:
    signature: dict  # config + parameter shapes before any wrapper shards them (checkpoint identity)
    parameter_counts: dict  # total / trainable (LoRA applied)
    lora_targets: list | None  # module names LoRA adapted, None for full fine-tuning
    flops: dict  # FLOPs per token (per image, ...: the task's unit) of the model as built
    described: dict  # what wraps the model, really (Strategy.describe), already verified


def prepare_model(strategy, model_source: str, spec: Spec) -> PreparedModel:
    """strategy.load_model -> LoRA -> strategy.wrap -> strategy.verify; collective."""
    import torch

    from distlab.runtime import buffers
    from distlab.checkpoints import checkpoint as ckpt
    from distlab.configuration.training_tools import adapts
    from distlab.runtime.activations import checkpointing_facts, enable_checkpointing
    from distlab.runtime.lora import parameter_counts
    from distlab.errors import FidelityError

    torch.manual_seed(spec.seed)
    model = strategy.load_model(model_source)
    # RoPE's inv_freq and other buffers as the plain model has them, whatever the loading path
    # or the transformers release did to them (distlab.runtime.buffers).
    plain = buffers.plain_buffers(model_source, strategy.task)
    restored = buffers.restore_plain_buffers(model, plain)
    lora_targets = None
    if adapts(spec):  # LoRA, or QLoRA (load_model gave the 4-bit base: distlab.runtime.qlora)
        with strategy.lora_context():
            model, lora_targets = strategy.task.apply_lora(model, spec)
    # FLOPs on the model as trained (LoRA applied), before any wrapper shards it; rank 0 counts
    # (one micro-batch of 1, no collective). Causal LM: formula and FlopCounterMode side by side.
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    flops = strategy.task.flops(model, spec, count=is_main)
    counts = parameter_counts(model)
    # After the FLOP count: its forward+backward counts the model's FLOPs, not the recompute's.
    enable_checkpointing(model, spec)
    signature = ckpt.model_signature(model)  # before a wrapper shards the parameters
    compiled = None
    if spec.compile:  # before the wrapper, as torchtitan does: it stays eager around the layers
        from distlab.runtime.compiled import compile_decoder_layers

        compiled = compile_decoder_layers(model)
    strategy.wrap(model)
    strategy.attach_scheduler()
    described = strategy.describe()
    described["activation_checkpointing"] = checkpointing_facts(strategy.model, spec)
    strategy.verify(described)
    wrapped = strategy.unwrapped()
    verify_tools(wrapped, spec, described, compiled)
    changed = buffers.buffer_mismatches(wrapped, plain)
    if changed:
        raise FidelityError(f"after {strategy.name}'s wrap, buffers differ in dtype from the plain model: {changed}")
    described["buffers"] = {"dtypes": buffers.buffer_dtypes(wrapped), "restored_before_wrap": restored,
                            "how": buffers.HOW}
    return PreparedModel(signature=signature, parameter_counts=counts, lora_targets=lora_targets, flops=flops,
                         described=described)


def verify_tools(model, spec: Spec, described: dict, compiled: dict | None) -> None:
    """Record what the wrapped model really holds of QLoRA and compilation, and fail the run
    when it differs from the spec (a qlora label without a 4-bit layer, layers not compiled)."""
    from distlab.errors import FidelityError

    if spec.method == "qlora":
        from distlab.runtime.qlora import check_quantized, quantization_facts

        facts = quantization_facts(model)
        problem = check_quantized(facts, spec)
        if problem:
            raise FidelityError(problem)
        described["quantization"] = facts
    if compiled is not None:
        from distlab.runtime.compiled import compiled_layer_counts

        found, held = compiled_layer_counts(model)
        if not found or found != held:
            raise FidelityError(f"compile: {found} of the {held} decoder layers this rank holds after the wrap run "
                                "compiled")
        described["compiled"] = {**compiled, "compiled_layers_found": found}

