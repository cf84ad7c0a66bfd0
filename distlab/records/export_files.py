"""Safetensors files written one tensor at a time, laid out as Hugging Face writes them.

A safetensors file is an 8-byte header length, a JSON header naming every tensor (dtype,
shape, byte range) and the tensors' bytes. When every name, shape and dtype is known before
any value exists, the header can be written first and each tensor put at its offset as it
arrives (os.pwrite), in any order: no process ever holds a whole file, let alone a whole
model. The bytes are those `safetensors.torch.save_file` writes (same header JSON, the same
tensor order: larger dtypes first, then by name; header padded with spaces to 8 bytes;
tests/test_export_files.py compares the files byte for byte).

Which tensors go into which file is transformers' own plan: `save_pretrained` removes tied
weights (`remove_tied_weights_from_state_dict`) and splits the state dict with
huggingface_hub's `split_torch_state_dict_into_shards(max_shard_size=...)`; `shard_plan` calls
the same two functions on a meta-device model, so the files and `model.safetensors.index.json`
are the ones `save_pretrained(max_shard_size=...)` writes for that model.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"  # shards a 7B fp32 export into 6 files; save_pretrained's own default is "50GB"

# safetensors' Dtype enum, in the order it sorts tensors within a file (largest alignment first).
_DTYPES = [("uint64", "U64"), ("int64", "I64"), ("float64", "F64"), ("float32", "F32"), ("uint32", "U32"),
           ("int32", "I32"), ("bfloat16", "BF16"), ("float16", "F16"), ("uint16", "U16"), ("int16", "I16"),
           ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("int8", "I8"), ("uint8", "U8"),
           ("bool", "BOOL")]


def _dtype_code(dtype) -> tuple[int, str]:
    """(sort rank, safetensors code) of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for rank, (torch_name, code) in enumerate(_DTYPES):
        if torch_name == name:
            return rank, code
    raise TypeError(f"safetensors cannot store dtype {dtype}")


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


class SafetensorsFile:
    """One safetensors file whose tensors (name -> (shape, dtype)) are declared up front and
    written one by one."""

    def __init__(self, path: str | os.PathLike, entries: dict[str, tuple], metadata: dict | None = None):
        import math

        self.path = Path(path)
        order = sorted(entries, key=lambda n: (_dtype_code(entries[n][1])[0], n))
        header: dict = {"__metadata__": metadata} if metadata else {}
        self.offsets, position = {}, 0
        for name in order:
            shape, dtype = entries[name]
            size = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _dtype_code(dtype)[1], "shape": list(shape),
                            "data_offsets": [position, position + size]}
            self.offsets[name] = (position, size, tuple(shape), dtype)
            position += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.size = self.data_start + position
        self.written: set[str] = set()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, tensor) -> None:
        """Put one tensor's bytes at its place; it must be a CPU tensor of the declared shape
        and dtype (a device tensor here is a bug upstream: the export is written from host memory)."""
        start, size, shape, dtype = self.offsets[name]
        if tensor.device.type != "cpu":
            raise ValueError(f"{self.path}: tensor '{name}' is on {tensor.device}; the export writes host (CPU) "
                             "tensors only")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{self.path}: tensor '{name}' is {tuple(tensor.shape)} {tensor.dtype}, declared "
                             f"{shape} {dtype}")
        if name in self.written:
            raise ValueError(f"{self.path}: tensor '{name}' written twice")
        flat = tensor.detach().contiguous().reshape(-1)
        import torch

        raw = memoryview(flat.view(torch.uint8).numpy()) if size else b""  # no copy: the tensor's own bytes
        written = 0
        while written < size:
            written += os.pwrite(self.fd, raw[written:], self.data_start + start + written)
        self.written.add(name)

    def close(self) -> None:
        missing = sorted(set(self.offsets) - self.written)
        os.fsync(self.fd)
        os.close(self.fd)
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} declared tensors were never written, e.g. {missing[:3]}")


def shard_plan(model, max_shard_size: int | str = MAX_SHARD_SIZE) -> dict:
    """{"files": {file: {name: (shape, dtype)}}, "index": the index JSON or None} of what
    `model.save_pretrained(max_shard_size=...)` writes for this (meta-device) model."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    split = split_torch_state_dict_into_shards(state, filename_pattern=SAFE_WEIGHTS_NAME.replace(
        ".safetensors", "{suffix}.safetensors"), max_shard_size=max_shard_size)
    files = {file: {name: (tuple(state[name].shape), state[name].dtype) for name in names}
             for file, names in split.filename_to_tensors.items()}
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
    return {"files": files, "index": index}


class ShardedWriter:
    """The weight files of a plan (shard_plan) in `folder`, filled tensor by tensor in any
    order; close() checks every tensor arrived and writes the index."""

    def __init__(self, folder: str | os.PathLike, plan: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.index = plan["index"]
        self.files = {file: SafetensorsFile(self.folder / file, entries, {"format": "pt"})
                      for file, entries in plan["files"].items()}
        self.where = {name: file for file, entries in plan["files"].items() for name in entries}

    def wants(self, name: str) -> bool:
        return name in self.where

    def write(self, name: str, tensor) -> None:
        self.files[self.where[name]].write(name, tensor)

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()
        if self.index is not None:
            text = json.dumps(self.index, indent=2, sort_keys=True) + "\n"
            (self.folder / SAFE_WEIGHTS_INDEX_NAME).write_text(text)


def save_hf_metadata(model, folder: str | os.PathLike, dtype) -> None:
    """config.json (+ generation_config.json) as save_pretrained writes them for `model` with
    weights stored in `dtype`."""
    config = model.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(folder))
    if model.can_generate():
        model.generation_config.save_pretrained(str(folder))


class WeightIndexError(ValueError):
    """A safetensors index that is not one to load weights by (unreadable, or pointing outside
    its folder); the message names the index file."""


def read_weight_map(index: str | os.PathLike) -> dict[str, str]:
    """{tensor name: file} of a safetensors index (model.safetensors.index.json and the like),
    every file named relative to the index's own folder: an absolute path or a '..' would make
    the loader read (and the export copy) a file from anywhere on the machine."""
    from pathlib import PurePosixPath

    index = Path(index)
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise WeightIndexError(f"{index}: unreadable weight index ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise WeightIndexError(f"{index}: field 'weight_map' is not an object of tensor names to file names")
    outside = sorted({file for file in weight_map.values()
                      if PurePosixPath(file).is_absolute() or Path(file).is_absolute() or "\\" in file
                      or ".." in PurePosixPath(file).parts})
    if outside:
        raise WeightIndexError(f"{index} names weight files outside its folder {index.parent}: {outside[:5]}; "
                               "a weight index names files of its own folder only")
    return weight_map


def weight_index(folder: str | os.PathLike) -> dict[str, str]:
    """{tensor name: file} of a Hugging Face weights folder (index, or the single file)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return read_weight_map(index)
    single = folder / SAFE_WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}")
    with safe_open(str(single), framework="pt") as handle:
        return {name: SAFE_WEIGHTS_NAME for name in handle.keys()}
