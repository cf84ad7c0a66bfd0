"""Load only what a rank holds: a skeleton whose parameters live on the meta device (no
memory), then the weights of the parameters this rank keeps, read one by one from the
model folder's safetensors (`safe_open` reads the requested keys only, memory-mapped).

Used by pipeline parallel (a stage reads its own layers) and tensor parallel (each rank
reads only its shard of each split weight, via `get_slice`).

Buffers are real from the start (`init_empty_weights(include_buffers=False)`): rotary
`inv_freq` and similar non-persistent buffers are computed by the model's own __init__,
never read from the file and never left empty.
"""
from __future__ import annotations

import json
from pathlib import Path


def empty_model(source: str):
    """The causal LM of `source` with every parameter on the meta device (fp32, as load_model)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(source))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # from_config leaves the meta lm_head untied: it is never stored on its own
    model.distlab_source = str(source)  # where wrap() reads the weights this rank keeps
    return model


def model_folder(source: str) -> Path:
    """A local folder, or the locally cached snapshot of a hub id (never a download)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, local_files_only=True))


def checkpoint_names(model, file_keys) -> dict[str, str]:
    """{model parameter name: stored key}, renamed the way from_pretrained renames them: the
    model's own conversion mapping (e.g. GPT-NeoX stores `embed_out.` for `lm_head.`) and the
    base model prefix added or stripped. Keys that from_pretrained would merge or split
    (WeightConverter) cannot be read piecewise and are refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    wanted = model.state_dict()
    names = {}
    for key in file_keys:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, wanted)
        if converted is not None:
            raise NotImplementedError(f"stored weight '{key}' is converted ({converted}) when {type(model).__name__} "
                                      "loads: it cannot be read piecewise for one rank")
        names[name] = key
    return names


class WeightFiles:
    """Which safetensors file holds each parameter of `model`, opened lazily."""

    def __init__(self, model):
        self.folder = model_folder(model.distlab_source)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            where = json.loads(index.read_text())["weight_map"]
        else:
            single = self.folder / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"{self.folder} has no model.safetensors(.index.json) to load weights from")
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as fh:
                where = {key: single.name for key in fh.keys()}
        self.where = where
        self.names = checkpoint_names(model, where)
        self.handles = {}

    def slice(self, name: str):
        """A lazy view of the stored tensor: index it ([a:b], [:, a:b]) to read only that part."""
        from safetensors import safe_open

        if name not in self.names:
            raise KeyError(f"parameter '{name}' is not in the safetensors of {self.folder}")
        key = self.names[name]
        file = self.where[key]
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.folder / file), framework="pt")
        return self.handles[file].get_slice(key)

    def close(self) -> None:
        """Unmap the files: pages read through a handle stay in this process's RSS until it
        closes, so a loader that kept one open for the whole model would count every page it
        touched (a TP column slice touches every page of its tensor)."""
        self.handles.clear()


def layer_groups(names) -> list[list[str]]:
    """`names` grouped by decoder layer (`...layers.<i>.`), then one group for the rest, in
    first-seen order: a loader that reads (and unmaps) one group at a time holds one
    layer's pages at a time."""
    import re

    groups: dict[str, list[str]] = {}
    for name in names:
        layer = re.match(r"(.*\.layers\.\d+\.)", name)
        groups.setdefault(layer.group(1) if layer else "", []).append(name)
    return list(groups.values())


def materialize(model, device, read, after_layer=None) -> int:
    """Give every meta parameter of `model` its real value: read(name, param) returns the tensor
    (on CPU) for that parameter as this rank holds it (a DTensor's local shard); after_layer()
    runs after each decoder layer's parameters (layer_groups), to unmap what was read. Returns
    the bytes this rank loaded."""
    loaded = 0
    params = dict(model.named_parameters())
    for group in layer_groups(name for name, p in params.items() if p.device.type == "meta"):
        loaded += _materialize_group(model, device, read, {name: params[name] for name in group})
        if after_layer is not None:
            after_layer()
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()  # the output embedding points at the input one again
    left = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"parameters left without weights after loading: {left[:5]}")
    model.to(device)  # buffers (computed, not loaded) follow the parameters
    return loaded


def _materialize_group(model, device, read, params: dict) -> int:
    import torch
    from accelerate.utils import set_module_tensor_to_device
    from torch import nn
    from torch.distributed.tensor import DTensor

    loaded = 0
    for name, param in params.items():
        # safetensors hands out views into the memory-mapped file, and a column slice's view
        # spans the whole stored tensor: a copy gives the parameter memory of its own, holding
        # only this rank's part (the file is unmapped after each layer: after_layer).
        value = read(name, param).to(device=device, dtype=param.dtype, memory_format=torch.contiguous_format,
                                     copy=True)
        if isinstance(param, DTensor):  # a tensor-parallel shard: `value` is this rank's local part
            owner, leaf = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            sharded = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                         shape=param.shape, stride=param.stride())
            owner._parameters[leaf] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        else:
            set_module_tensor_to_device(model, name, device, value=value)
        loaded += value.numel() * value.element_size()
    return loaded


def local_part(param) -> tuple:
    """The index (slices) of the stored tensor that this rank holds of a (meta) parameter."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tuple(slice(None) for _ in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def load_held_weights(model, device) -> int:
    """Fill every meta parameter this rank kept (a pipeline stage's; a tensor-parallel rank's
    shards) from the folder, reading only that part. Returns the bytes read."""
    if not any(p.device.type == "meta" for p in model.parameters()):
        model.to(device)  # a model loaded whole (tests, callers outside a strategy): nothing to read
        return 0
    files = WeightFiles(model)
    return materialize(model, device, lambda name, param: files.slice(name)[local_part(param)],
                       after_layer=files.close)
