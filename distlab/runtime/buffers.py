"""A model's non-parameter buffers keep the dtype the plain model has, under every strategy.

Model code declares some buffers in fp32 whatever the weights' dtype, RoPE's `inv_freq` first
of all (Llama: `1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)`). Loading
paths can change them behind the code's back: `deepspeed.zero.Init` wraps `torch.arange` and
casts every floating result to the run's dtype, so a bf16 ZeRO-3 build gets a bf16 `inv_freq`
with rounded values (0.31640625 for 0.31622777) and trains a slightly different function from
the one it exports and evaluates. transformers guards its own ZeRO-3 path against this only
from some 5.x release on (`prevent_arange_dtype_change` in transformers.integrations.deepspeed:
in 5.24, not in 5.17, the GPU box's). distlab does not rely on any library's guard:

- the plain model's buffers are computed once per process from the model's own code
  (the architecture built on the meta device, buffers real, fp32, no zero.Init around it);
- before LoRA and the wrap, every buffer that differs from them is put back
  (`restore_plain_buffers`): computed (non-persistent) buffers take the plain values and dtype,
  persistent ones (loaded from the checkpoint) keep their values in the plain dtype;
- after the wrap, a buffer whose dtype still differs fails the run (`buffer_mismatches`):
  wrappers hold references to buffers, so they are not swapped under them.
"""
from __future__ import annotations

import functools

import torch

HOW = ("each buffer of the model as built vs the plain model's (the architecture built on the meta device, "
       "buffers computed by its own code, outside any strategy); differing ones put back before the wrap, "
       "dtypes checked again after it")


@functools.lru_cache(maxsize=4)
def _plain(model_source: str, task) -> tuple[tuple[str, torch.Tensor, bool], ...]:
    model = task.load_model(model_source, device="meta")  # the task's trained module
    out = []
    for name, buffer in model.named_buffers():
        if buffer.device.type == "meta":
            continue
        module_name, _, leaf = name.rpartition(".")
        persistent = leaf not in model.get_submodule(module_name)._non_persistent_buffers_set
        out.append((name, buffer.detach().clone(), persistent))
    return tuple(out)


def plain_buffers(model_source: str, task) -> dict[str, tuple[torch.Tensor, bool]]:
    """{name: (tensor, persistent)} of the plain model's real buffers (Hugging Face names); the
    model is the trained module of `task` (a distlab.tasks Task, handed in by the rank: the
    kernels name no task)."""
    return {name: (tensor, persistent) for name, tensor, persistent in _plain(str(model_source), task)}


def _plain_name(name: str, plain: dict) -> str | None:
    """The plain model's name for a buffer of a possibly wrapped model (peft, DDP prefixes)."""
    if name in plain:
        return name
    return next((key for key in plain if name.endswith("." + key)), None)


def restore_plain_buffers(model, plain: dict) -> list[str]:
    """Put back every buffer of `model` (before any wrapper) that differs from the plain model's;
    returns the names put back."""
    restored = []
    for name, buffer in list(model.named_buffers()):
        key = _plain_name(name, plain)
        if key is None or buffer.device.type == "meta":
            continue
        reference, persistent = plain[key]
        if persistent:  # loaded from the checkpoint: its values stand, only the dtype is the plain one
            if buffer.dtype == reference.dtype:
                continue
            value = buffer.detach().to(reference.dtype)
        else:
            if buffer.dtype == reference.dtype and buffer.shape == reference.shape and \
                    torch.equal(buffer.detach().cpu(), reference):
                continue
            value = reference.clone()
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._buffers[leaf] = value.to(buffer.device)
        restored.append(name)
    return restored


def buffer_mismatches(model, plain: dict) -> list[str]:
    """'name: dtype, plain dtype' for each buffer whose dtype differs from the plain model's."""
    out = []
    for name, buffer in model.named_buffers():
        key = _plain_name(name, plain)
        if key is not None and buffer.dtype != plain[key][0].dtype:
            out.append(f"{name}: {buffer.dtype}, the plain model has {plain[key][0].dtype}")
    return out


def buffer_dtypes(model) -> dict[str, str]:
    return {name: str(buffer.dtype).replace("torch.", "") for name, buffer in model.named_buffers()}
