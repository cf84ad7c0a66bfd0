"""Load only what a rank holds: a skeleton whose parameters live on the meta device (no
memory), then the weights of the parameters this rank keeps, read one by one from the
model folder's safetensors (`safe_open` reads the requested keys only, memory-mapped).

Used by pipeline parallel (a stage reads its own layers) and tensor parallel (each rank
reads only its shard of each split weight, via `get_slice`).

Buffers are real from the start (`init_empty_weights(include_buffers=False)`): rotary
`inv_freq` and similar non-persistent buffers are computed by the model's own __init__,
never read from the file and never left empty.

The one sharded loader: `ShardedLoad.run` decides which stored weight each parameter reads,
checks that every parameter to fill is in the model folder (`check_coverage`, the one check,
naming the missing ones) before anything is read, then reads one decoder layer at a time; each
strategy keeps only its placement in a small subclass: `RankSlices` here (tensor parallel's
shards, a pipeline stage's layers), `strategies.deepspeed_load.ZeroPartitions` (ZeRO-3's flat
partitions) and `strategies.fsdp_load.DCPShards` (FSDP2's DTensor shards, read by DCP).
"""
from __future__ import annotations

from pathlib import Path

from distlab.configuration.model_files import checkpoint_names


def model_folder(source: str) -> Path:
    """A local folder, or the locally cached snapshot of a hub id (never a download)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, local_files_only=True))


class WeightFiles:
    """Which safetensors file holds each parameter of `model`, opened lazily."""

    def __init__(self, model):
        self.folder = model_folder(model.distlab_source)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            from distlab.records.export_files import read_weight_map

            where = read_weight_map(index)
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


class MissingWeights(RuntimeError):
    """A sharded load found parameters the model folder does not hold (raised before any read)."""


def check_coverage(loader: str, folder, wanted, stored, otherwise: str = "") -> None:
    """Every parameter in `wanted` is in `stored` (the folder's weights, by parameter name), or
    MissingWeights naming the missing ones; `otherwise` says what else filled the rest."""
    missing = [name for name in wanted if name not in stored]
    if missing:
        beside = f" (nor {otherwise})" if otherwise else ""
        raise MissingWeights(f"{loader} sharded load: {len(missing)} parameters are not in the safetensors of "
                             f"{folder}{beside}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


class ShardedLoad:
    """One rank's load of its part of a model from the model folder's safetensors. run():
    the parameters to fill (`targets`), which stored weight each reads (`stored`), the coverage
    check, then `load_layer` for each decoder layer's group (layer_groups) and `after_layer`
    (unmap what was read); `finish` gives the report. Subclasses place the weights."""

    loader = ""  # names the load in errors
    otherwise = ""  # what fills the targets the folder does not hold (none: every one must be there)

    def __init__(self, model, folder):
        self.model, self.folder = model, folder

    def targets(self) -> dict:
        """{parameter name: parameter} this rank fills (tied parameters once)."""
        return dict(self.model.named_parameters())

    def stored(self) -> dict[str, str]:
        """{parameter name: stored key} of the parameters the folder holds."""
        raise NotImplementedError

    def filled_otherwise(self) -> set[str]:
        """Targets that do not come from the folder (FSDP: LoRA adapters restored as peft made them)."""
        return set()

    def load_layer(self, names: list[str], params: dict) -> int:
        """Read and place these parameters' parts; returns the bytes read."""
        raise NotImplementedError

    def after_layer(self) -> None:
        """After each group: release what reading it mapped."""

    def finish(self, bytes_read: int) -> dict:
        return {"bytes_read": bytes_read}

    def run(self) -> dict:
        targets, stored, otherwise = self.targets(), self.stored(), self.filled_otherwise()
        check_coverage(self.loader, self.folder, [n for n in targets if n not in otherwise], stored, self.otherwise)
        read = 0
        for group in layer_groups(n for n in targets if n not in otherwise):
            read += self.load_layer(group, targets)
            self.after_layer()
        return self.finish(read)


class RankSlices(ShardedLoad):
    """Tensor and pipeline parallel: every meta parameter this rank kept (a pipeline stage's
    layers; a tensor-parallel rank's shards) gets the part of the stored tensor it holds, read
    with safetensors' get_slice and copied into memory of its own (local_part)."""

    loader = "tensor/pipeline parallel"

    def __init__(self, model, device):
        self.files = WeightFiles(model)
        super().__init__(model, self.files.folder)
        self.device = device

    def targets(self):
        return {name: p for name, p in self.model.named_parameters() if p.device.type == "meta"}

    def stored(self):
        return self.files.names

    def load_layer(self, names, params):
        def read(name, param):
            return self.files.slice(name)[local_part(param)]

        return _materialize_group(self.model, self.device, read, {name: params[name] for name in names})

    def after_layer(self):
        self.files.close()

    def finish(self, bytes_read):
        if getattr(self.model.config, "tie_word_embeddings", False) and hasattr(self.model, "tie_weights"):
            self.model.tie_weights()  # the output embedding points at the input one again
        self.model.to(self.device)  # buffers (computed, not loaded) follow the parameters
        return super().finish(bytes_read)


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
    return RankSlices(model, device).run()["bytes_read"]
