"""One precision map: the spec's `precision` names (fp32, bf16, fp16), the torch dtype each
stands for, and what each library is told for it. Every strategy, the hardware probe and the
tasks read them here, so a precision means the same thing everywhere. Torch is imported only
by the functions that return a torch dtype (the config layer and the launchers stay torch-free).
"""
from __future__ import annotations

from distlab.records.spec import SpecFields

#: The 16-bit precisions a run may compute in (mixed precision, fp32 masters).
LOW_PRECISIONS = ("bf16", "fp16")
#: Every precision a spec may name (the schemas' precision enums: distlab.configuration.axes).
PRECISIONS = ("fp32", *LOW_PRECISIONS)
#: Accelerate's `mixed_precision` (config file and Accelerator argument) for each spec precision.
ACCELERATE_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def is_mixed(precision: str) -> bool:
    """Whether the run computes in a 16-bit dtype (autocast, a MixedPrecisionPolicy, DeepSpeed's bf16/fp16)."""
    return precision in LOW_PRECISIONS


def torch_dtype(precision: str):
    """The torch dtype of a precision name (fp32 -> torch.float32; tf32, a matmul mode of fp32
    tensors, is float32 too)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def low_precision_dtype(precision: str):
    """The 16-bit dtype a mixed-precision run computes in (autocast, FSDP's param_dtype); None for fp32."""
    return torch_dtype(precision) if is_mixed(precision) else None


def autocast(spec: SpecFields, device):
    """torch.autocast in the run's 16-bit dtype around a forward (a null context for fp32)."""
    import contextlib

    import torch

    dtype = low_precision_dtype(spec.precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def frozen_base_precision(method: str | None, precision: str | None) -> str:
    """The precision whole-model strategies (DDP, Accelerate) load weights in: LoRA's frozen base
    in bf16 when precision is bf16 (it is never stepped, autocast computes in bf16 anyway;
    peft keeps the adapters in fp32), else fp32 (full fine-tuning: the weights are the
    optimizer's fp32 masters under autocast). The advisor counts the same bytes (ddp_settings)."""
    return "bf16" if method == "lora" and precision == "bf16" else "fp32"


def frozen_base_dtype(spec: SpecFields):
    """frozen_base_precision as a torch dtype, for the spec's method and precision."""
    return torch_dtype(frozen_base_precision(spec.method, spec.precision))


def deepspeed_precision(precision: str) -> dict:
    """The `bf16` and `fp16` blocks of a DeepSpeed config: the engine keeps its module in that
    dtype, with fp32 masters in the optimizer."""
    return {"bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}}


def dtype_name(dtype) -> str:
    """'float32' for torch.float32: how as_built records a dtype."""
    return str(dtype).replace("torch.", "")


def parameter_dtype_mismatch(precision: str, parameter_dtypes: dict, master_dtypes: dict | None,
                             method: str | None = None) -> str | None:
    """Why the dtypes a rank holds contradict its precision, or None. An fp32 run holds only fp32
    parameters; a mixed-precision run holds fp32 and its 16-bit dtype (DeepSpeed's 16-bit module,
    a LoRA run's frozen bf16 base); the tensors an optimizer steps (its masters) are fp32 in both.
    The label alone is not trusted: DeepSpeed once built an fp32 run's ZeRO-3 parameters in bf16
    (strategies.deepspeed_load.zero_init). QLoRA's frozen 4-bit weights are stored packed in
    uint8 (bitsandbytes' quant storage; runtime.qlora checks that they are Linear4bit layers)."""
    allowed = {"float32"} | ({dtype_name(low_precision_dtype(precision))} if is_mixed(precision) else set())
    if method == "qlora":
        allowed.add("uint8")
    stray = sorted(set(parameter_dtypes) - allowed)
    if stray:
        return (f"precision {precision} implies parameters in {sorted(allowed)}, but this rank holds "
                f"{parameter_dtypes} (elements per dtype)")
    masters = sorted(set(master_dtypes or {}) - {"float32"})
    if masters:
        return f"precision {precision} implies fp32 optimizer masters, but the optimizer steps {master_dtypes}"
    return None
