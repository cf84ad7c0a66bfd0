"""QLoRA (`method: qlora`): the frozen base loaded in 4-bit NF4 with double quantisation by
bitsandbytes (transformers' BitsAndBytesConfig, as QLoRA's paper and every peer set it up),
prepared with peft's prepare_model_for_kbit_training, then LoRA adapters as for `method: lora`
(distlab.runtime.lora). bitsandbytes runs on CUDA and on the CPU (its own CPU backend, 0.50 here).
Strategies: ddp, accelerate, deepspeed ZeRO 0-2 (distlab.configuration.training_tools refuses the rest).

What the run trains is the 4-bit base + adapters; what it exports is the adapter folder, which a
user loads on the full-precision base with plain peft. So every logit distlab records and checks
for a QLoRA checkpoint (distlab.runtime.streamed) comes from the full-precision base read from the
model folder plus the trained adapters (`trained_groups`), as the export is used.
"""
from __future__ import annotations

import torch

from distlab.records.spec import Spec

QUANT_TYPE = "nf4"


def compute_dtype(spec: Spec):
    """bnb_4bit_compute_dtype: the dtype the 4-bit weights are dequantised to for each matmul,
    the run's precision (bf16 or fp32; fp16 is refused at config time)."""
    from distlab.configuration.precision import torch_dtype

    return torch_dtype(spec.precision)


def quantization_config(spec: Spec):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype(spec), bnb_4bit_quant_storage=torch.uint8)


def load_quantized(source: str, spec: Spec, device: torch.device):
    """The base with its decoder layers' Linear layers in 4-bit NF4 on `device` (bitsandbytes
    quantises as from_pretrained places them; the embedding, norms and head stay fp32)."""
    from transformers import AutoModelForCausalLM

    place = {"": device.index if device.type == "cuda" else "cpu"}
    model, info = AutoModelForCausalLM.from_pretrained(str(source), quantization_config=quantization_config(spec),
                                                       dtype=torch.float32, device_map=place,
                                                       output_loading_info=True)
    if info["missing_keys"]:
        raise ValueError(f"{source}: the weight files lack {sorted(info['missing_keys'])[:8]}")
    return model


def apply_qlora(model, spec: Spec):
    """prepare_model_for_kbit_training (every base weight frozen, the non-quantised ones in fp32),
    then the run's LoRA adapters: (PeftModel, target names). Activation checkpointing is left to
    the run's own setting (distlab.runtime.activations), not turned on here as peft's default does."""
    from peft import prepare_model_for_kbit_training

    from distlab.runtime.lora import apply_lora

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return apply_lora(model, spec.lora, spec.seed)


def quantization_facts(model) -> dict:
    """What the model holds, read from its modules and weights: bitsandbytes Linear4bit layers
    (with and without LoRA around them), plain Linear layers, and the 4-bit weights' format."""
    import bitsandbytes as bnb

    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    states = [m.weight.quant_state for m in four_bit if getattr(m.weight, "quant_state", None) is not None]
    packed = sum(m.weight.numel() * m.weight.element_size() for m in four_bit)
    elements = sum(s.shape.numel() for s in states)
    return {"linear4bit_layers": len(four_bit), "plain_linear_layers": len(plain),
            "quant_types": sorted({s.quant_type for s in states}),
            "double_quantisation": bool(states) and all(s.nested for s in states),
            "compute_dtypes": sorted({str(m.compute_dtype).removeprefix("torch.") for m in four_bit}),
            "stored_dtypes": sorted({str(s.dtype).removeprefix("torch.") for s in states}),
            "quantised_parameters": elements, "packed_weight_bytes": packed,
            "bytes_per_quantised_parameter": packed / elements if elements else None,
            "bitsandbytes": bnb.__version__,
            "how": "bitsandbytes.nn.Linear4bit modules of the model as wrapped (their compute_dtype), their "
                   "Params4bit quant_state (quant_type, nested = double quantisation, the dtype the weight was "
                   "stored in); packed bytes exclude the absmax statistics"}


def check_quantized(facts: dict, spec: Spec) -> str | None:
    """Why the model as built is not the QLoRA the spec asks for (None when it is)."""
    if not facts["linear4bit_layers"]:
        return "method qlora, but the model holds no bitsandbytes Linear4bit layer (the base is not 4-bit)"
    if facts["quant_types"] != [QUANT_TYPE] or not facts["double_quantisation"]:
        return (f"method qlora expects NF4 with double quantisation; the layers hold {facts['quant_types']}, "
                f"double quantisation {facts['double_quantisation']}")
    wanted = str(compute_dtype(spec)).removeprefix("torch.")
    if facts["compute_dtypes"] != [wanted]:
        return f"method qlora computes in {wanted} here; the layers compute in {facts['compute_dtypes']}"
    return None


def trained_groups(strategy, spec: Spec, source: str):
    """The state groups every recorded and checked logit is computed from (collective,
    distlab.runtime.streamed): the strategy's own for full fine-tuning and LoRA; for QLoRA the
    trained adapters with the full-precision base weights read from the model folder, the model
    the export is loaded as."""
    if spec.method != "qlora":
        return strategy.state_groups()
    return _adapters_on_full_precision_base(strategy, spec, source)


def _adapters_on_full_precision_base(strategy, spec: Spec, source: str):
    import torch.distributed as dist

    from distlab.records.export_files import weight_index
    from distlab.runtime.lora import base_name
    from distlab.configuration.model_files import checkpoint_names
    from distlab.runtime.partial_load import model_folder
    from distlab.runtime.streamed import Skeleton, open_weights, parameter_groups

    adapters = strategy.state_groups(select=lambda name: "lora_" in name)
    if dist.get_rank() != 0:
        for group in adapters:  # every rank iterates to the end (a sharded strategy gathers)
            yield group
        return
    model = Skeleton.for_run(source, spec).model  # the names and order the streamed forward expects
    folder = model_folder(source)
    stored = checkpoint_names(model.get_base_model(), weight_index(folder))
    keys = {name: stored[base_name(name)] for name, _ in model.named_parameters() if "lora_" not in name}
    with open_weights(folder, keys) as reader:
        for names in parameter_groups(model):
            group = {name: reader.read(name) for name in names if "lora_" not in name}
            wanted = {name for name in names if "lora_" in name}
            if wanted:
                trained = next(adapters, {})
                if set(trained) != wanted:
                    raise RuntimeError(f"QLoRA adapters arrived as {sorted(trained)[:2]}, the layer has "
                                       f"{sorted(wanted)[:2]}")
                group.update(trained)
            yield group
            reader.close()
    left = [name for group in adapters for name in group]
    if left:
        raise RuntimeError(f"QLoRA adapters not placed in the full-precision model: {left[:3]}")
