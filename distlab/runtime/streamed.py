"""A model run and written one decoder layer at a time, so no process holds all its weights.

The export, the logits recorded with a checkpoint and every check that compares logits
(validation's reload, resume, reshard and export checks) run here, on rank 0, on the CPU in
fp32, whatever device and precision trained the model: a GPU's kernels and a CPU's differ by
more than the 1e-5 the checks allow, so every side of a comparison is computed by this code.

- `parameter_groups`: a model's parameters in the order they are streamed: each decoder layer
  as one group, every other parameter alone, in `named_parameters()` order.
- `Skeleton`: the architecture on the meta device (no memory for weights), the plain Hugging Face
  model or, for LoRA, the PeftModel; groups of CPU tensors are placed into it and released.
- `streamed_logits`: the skeleton's own forward on a batch, pulling each decoder layer's group
  from an iterator just before the layer runs and releasing it right after, so rank 0 holds one
  layer (plus the embedding and head while they are in use). The iterator is a strategy's
  collective `state_groups()` (the training state, gathered layer by layer) or the groups read
  from safetensors files (`file_groups`).
"""
from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from distlab.records.spec import Spec
from distlab.configuration.training_tools import adapts


def parameter_groups(model, select=None) -> list[list[str]]:
    """Names of `model`'s parameters (tied ones once) grouped as streamed: one group per
    decoder layer, one per other parameter; `select(name)` keeps only some (empty groups go)."""
    from distlab.runtime.model import decoder_layer_class

    layer_cls = decoder_layer_class(model)
    prefixes = [name + "." for name, module in model.named_modules() if isinstance(module, layer_cls)]
    pattern = re.compile("|".join(re.escape(p) for p in sorted(prefixes, key=len, reverse=True))) if prefixes else None
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        if select is not None and not select(name):
            continue
        found = pattern.match(name) if pattern else None
        groups.setdefault(found.group(0) if found else name, []).append(name)
    return list(groups.values())


def host(tensor, copy: bool = False):
    """The tensor in host memory (a CUDA tensor is copied; a CPU one is returned as is unless
    `copy`): what the export, the CPU forward and the files are made from."""
    out = tensor.detach().to("cpu")
    return out.clone() if copy and tensor.device.type == "cpu" else out  # a CPU .to() shares the storage


class Skeleton:
    """A model whose parameters are on the meta device (no memory), on rank 0; weights are
    placed one group at a time. Parameters that are real from the start (LoRA adapters peft
    loaded from a small file) stay in place and count as present."""

    def __init__(self, model):
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        self.model = model.eval()
        # Every (module, attribute) holding a parameter, by its one name (tied weights: two slots).
        names = {id(p): n for n, p in model.named_parameters()}
        self.slots: dict[str, list] = {}
        for _, module in model.named_modules():
            for leaf, param in module._parameters.items():
                if param is not None:
                    self.slots.setdefault(names[id(param)], []).append((module, leaf))
        self.shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
        self.fixed = {n for n, p in model.named_parameters() if p.device.type != "meta"}
        self.resident: set[str] = set()

    @classmethod
    def for_run(cls, model_source: str, spec: Spec) -> "Skeleton":
        """The run's architecture: the plain Hugging Face model, or for LoRA the PeftModel with
        the run's adapter config (its adapters' values arrive with the groups)."""
        from distlab.runtime.lora import apply_lora
        from distlab.runtime.model import load_model

        model = load_model(model_source, dtype=torch.float32, device="meta")
        if adapts(spec):  # QLoRA's too: its adapters are read with the full-precision base
            # apply_lora seeds and draws the adapters' initial values: the caller's RNG (the
            # trainer state of a run that goes on) must not move.
            with torch.random.fork_rng(devices=[]):
                model, _ = apply_lora(model, spec.lora, spec.seed)
        skeleton = cls(model)
        skeleton.fixed = set()  # every value, the adapters' included, comes with the groups
        return skeleton

    def place(self, group: dict) -> None:
        for name, tensor in group.items():
            if name not in self.slots:
                raise KeyError(f"streamed weights: '{name}' is no parameter of the {type(self.model).__name__} "
                               "skeleton")
            shape, dtype = self.shapes[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"streamed weights: '{name}' is {tuple(tensor.shape)}, the model expects {shape}")
            if tensor.device.type != "cpu":
                raise ValueError(f"streamed weights: '{name}' arrived on {tensor.device}; the CPU forward needs "
                                 "host tensors (Strategy.state_groups moves them)")
            param = nn.Parameter(tensor.to(dtype), requires_grad=False)
            for module, leaf in self.slots[name]:
                module._parameters[leaf] = param
            self.resident.add(name)

    def release(self, names) -> None:
        for name in names:
            if name not in self.resident:
                continue
            shape, dtype = self.shapes[name]
            empty = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
            for module, leaf in self.slots[name]:
                module._parameters[leaf] = empty
            self.resident.discard(name)

    def tied(self, name: str) -> bool:
        return len(self.slots[name]) > 1


def streamed_logits(skeleton: Skeleton, groups, input_ids, on_group=None):
    """Logits (fp32, CPU) of the skeleton on `input_ids`, its weights taken from `groups` (an
    iterator of {name: CPU tensor}) as the forward reaches them. on_group(skeleton, group) runs
    once per group while it is placed (the export writes it there). The iterator is drained:
    groups the forward did not need are placed, handed to on_group and released."""
    from distlab.runtime.model import decoder_layers

    model = skeleton.model
    source = iter(groups)
    layers = decoder_layers(model)
    prefix = {id(module): name for name, module in model.named_modules()}
    layer_names = [{f"{prefix[id(layer)]}.{n}" for n, _ in layer.named_parameters()} for layer in layers]
    early: list[str] = []  # groups pulled before the first layer (the embedding): released once it ran

    def pull_one() -> set[str] | None:
        group = next(source, None)
        if group is None:
            return None
        skeleton.place(group)
        if on_group is not None:
            on_group(skeleton, group)
        return set(group)

    def pull_until(needed: set[str]) -> None:
        needed = needed - skeleton.fixed
        while not needed <= skeleton.resident:
            if pull_one() is None:
                missing = sorted(needed - skeleton.resident)
                raise RuntimeError(f"streamed weights ended before the forward got {missing[:3]}")

    def before_layer(index):
        def hook(_module, _args, _kwargs=None):
            if index == 0:
                skeleton.release([n for n in early if not skeleton.tied(n)])
            pull_until(layer_names[index])
        return hook

    def after_layer(index):
        def hook(_module, _args, _output):
            skeleton.release(layer_names[index])
            if index == len(layers) - 1:  # the final norm and head come after the last layer
                while pull_one() is not None:
                    pass
        return hook

    def before_model(_module, _args, _kwargs=None):
        # Everything streamed before the first decoder layer (the embedding) is needed first.
        first = layer_names[0] if layer_names else set()
        while True:
            pulled = pull_one()
            if pulled is None:
                return
            if pulled & first:
                return
            early.extend(pulled)

    handles = [model.register_forward_pre_hook(before_model)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before_layer(i)))
        handles.append(layer.register_forward_hook(after_layer(i)))
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids.to("cpu")).logits.float()
        while pull_one() is not None:  # drain: anything the forward did not use
            pass
    finally:
        for handle in handles:
            handle.remove()
        skeleton.release(list(skeleton.resident))
    return logits


@contextlib.contextmanager
def open_weights(folder, names_to_keys: dict[str, str] | None = None):
    """A reader of tensors from a Hugging Face weights folder (index or single file): read(name)
    returns a CPU tensor; close() unmaps what was read (call it after each group)."""
    from safetensors import safe_open

    from distlab.records.export_files import weight_index

    where = weight_index(folder)
    handles: dict = {}

    class Reader:
        def read(self, name: str):
            key = names_to_keys.get(name, name) if names_to_keys else name
            if key not in where:
                raise KeyError(f"{folder}: no tensor '{key}'")
            file = where[key]
            if file not in handles:
                handles[file] = safe_open(f"{folder}/{file}", framework="pt")
            return handles[file].get_tensor(key)

        def close(self):
            handles.clear()

    reader = Reader()
    try:
        yield reader
    finally:
        reader.close()


def file_groups(skeleton: Skeleton, reader, cast=None, select=None):
    """Groups (parameter_groups of the skeleton) read from files; `cast`: dtype the values pass
    through first (the dtype the training run held them in); `select`: which names to read."""
    for names in parameter_groups(skeleton.model, select):
        group = {}
        for name in names:
            value = reader.read(name)
            if cast is not None and value.is_floating_point():
                value = value.to(cast)
            group[name] = value
        yield group
        reader.close()
