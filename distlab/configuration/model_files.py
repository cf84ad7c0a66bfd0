"""A model folder's weights checked before any job (`distlab.configuration.config.load(..., probe=True)`).

from_pretrained fills a parameter the files lack with random values and only warns: a folder
missing most of its weights trained as a random model under DDP, Accelerate and ZeRO 0-2
while the sharded loaders refused it. So, before any job:
- every safetensors file is read up to its header only (names, dtypes, shapes, byte offsets;
  no tensor is loaded) and must be as long as its header says (a truncated copy fails);
- the sizes are plausible: config.json's dimensions give a rough parameter count, and the
  files must hold at least a sixteenth of it (quantized weights pack several per element),
  checked before anything is built (a config.json claiming 3e12 parameters beside a 4-byte
  file stops here, without allocating for it);
- the architecture is built on the meta device (no memory) and every parameter must have a
  stored weight of its shape, names mapped the way from_pretrained maps them
  (checkpoint_names' renamings, the base model prefix added or dropped). The sharded loaders
  (distlab.runtime.partial_load) build and name a model's weights through the same two functions.
A `pytorch_model*.bin` folder is read with torch.load(mmap=True, weights_only=True) for its
names and shapes.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from distlab.errors import ConfigError

ELEMENTS_SLACK = 16  # 4-bit weights packed into int32 hold 8 per element; a little more for scales
HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header's length


def safetensors_header(path: Path, field: str) -> dict:
    """{name: (dtype, shape)} from a .safetensors header, after checking the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ConfigError(f"config field '{field}': {path} is not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(HEADER_LIMIT, size - 8):
            raise ConfigError(f"config field '{field}': {path} is not a whole safetensors file (its header claims "
                              f"{length} bytes, the file has {size})")
        try:
            header = json.loads(fh.read(length))
        except ValueError as error:
            raise ConfigError(f"config field '{field}': {path}: unreadable safetensors header ({error})") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + length + end > size:
        raise ConfigError(f"config field '{field}': {path} is truncated: its header describes {8 + length + end} "
                          f"bytes, the file has {size}")
    return {name: (v["dtype"], tuple(v["shape"])) for name, v in tensors.items()}


def stored_weights(folder: Path, field: str) -> dict:
    """{stored name: (dtype, shape)} of every weight file of the folder, no tensor loaded."""
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        from distlab.records.export_files import WeightIndexError, read_weight_map

        try:
            listed = sorted(set(read_weight_map(index).values()))
        except WeightIndexError as exc:
            raise ConfigError(f"config field '{field}': {exc}") from None
        missing = [name for name in listed if not (folder / name).is_file()]
        if missing:
            raise ConfigError(f"config field '{field}': {index} lists weight files that are not there: {missing[:5]}")
        files = [folder / name for name in listed]
    stored = {}
    for path in files:
        stored.update(safetensors_header(path, field))
    if not files:
        import torch

        for path in sorted(folder.glob("pytorch_model*.bin")):
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            stored.update({k: (str(v.dtype), tuple(v.shape)) for k, v in state.items()})
    return stored


def rough_parameter_count(config: dict) -> int:
    """An order-of-magnitude count from config.json alone (decoder-only transformer)."""
    def first(*names, default=0):
        return next((int(config[n]) for n in names if isinstance(config.get(n), int)), default)

    hidden = first("hidden_size", "n_embd", "d_model")
    layers = first("num_hidden_layers", "n_layer", "num_layers")
    vocab = first("vocab_size")
    inner = first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    return vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner)


def check_plausible(config: dict, stored: dict, folder: Path, field: str) -> None:
    elements = sum(math.prod(shape) for _, shape in stored.values())
    expected = rough_parameter_count(config)
    if elements * ELEMENTS_SLACK < expected:
        raise ConfigError(f"config field '{field}': {folder}/config.json describes a model of about {expected:.3g} "
                          f"parameters, but its weight files hold {elements:.3g} values: the files or the config are "
                          "not this model's")


def check_model_weights(folder: str | os.PathLike, field: str = "model.path") -> dict:
    """Every parameter of the folder's architecture has a stored weight of its shape; returns
    {"parameters": n, "stored": n}. Raises ConfigError naming the missing or misshapen ones."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    stored = stored_weights(folder, field)
    if not stored:
        raise ConfigError(f"config field '{field}': the weight files of {folder} hold no tensor")
    check_plausible(config, stored, folder, field)
    model = empty_model(str(folder))
    try:
        names = checkpoint_names(model, stored)
    except NotImplementedError:  # weights from_pretrained merges or splits (fused experts): not checked
        return {"parameters": sum(1 for _ in model.parameters()), "stored": len(stored), "names_checked": False}
    by_name = {name: stored[key] for name, key in names.items()}
    missing, misshapen = [], []
    for name, parameter in model.named_parameters():  # tied weights once, under their first name
        if name not in by_name:
            missing.append(name)
        elif tuple(by_name[name][1]) != tuple(parameter.shape):
            misshapen.append(f"{name} {list(by_name[name][1])} (the architecture has {list(parameter.shape)})")
    if missing or misshapen:
        total = len(missing) + len(misshapen)
        listed = (missing + misshapen)[:8]
        raise ConfigError(f"config field '{field}': the weight files of {folder} lack {len(missing)} and misshape "
                          f"{len(misshapen)} of the {sum(1 for _ in model.parameters())} parameters of its "
                          f"architecture ({type(model).__name__}): {', '.join(listed)}"
                          + (f" and {total - len(listed)} more" if total > len(listed) else "")
                          + "; from_pretrained would start those from random values")
    return {"parameters": sum(1 for _ in model.parameters()), "stored": len(stored), "names_checked": True}


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
