"""FSDP2's sharded load: from a meta-device model whose layers are already fully_shard-ed
to real weights, with no rank ever holding more than its shards (torchtitan's recipe).

1. `to_empty` gives every parameter shard real (uninitialised) memory on the rank's device.
2. Buffers are put back: they were built for real on the CPU with the model (rotary
   inv_freq is non-persistent: not in the checkpoint, so it must be computed, not loaded).
3. The base weights are read by torch.distributed.checkpoint with its
   HuggingFaceStorageReader straight from the model folder's safetensors into the DTensor
   shards: each rank reads only the slices it owns.
4. LoRA adapters (not in the checkpoint) get the values peft initialised them with from the
   seeded RNG (kept by keep_adapter_init while peft moved them to meta), so the step-0 loss
   equals DDP's.
Every parameter must be covered by 3 or 4, or the run fails naming the ones left empty
(distlab.runtime.partial_load.check_coverage, before anything is read).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from distlab.runtime.partial_load import ShardedLoad

ADAPTER_INIT_ATTRIBUTE = "_distlab_adapter_init"


@contextlib.contextmanager
def keep_adapter_init():
    """peft builds each LoRA adapter on the CPU and initialises it (consuming the seeded RNG
    exactly as on a real model), then moves it to its base layer's device: on a meta model
    that move erases the values. Keep a copy first, cast as peft casts it (base dtype)."""
    from peft.tuners.lora.layer import LoraLayer

    original = LoraLayer._move_adapter_to_device_of_base_layer

    def move_keeping_values(self, adapter_name, device=None):
        weight = getattr(self.get_base_layer(), "weight", None)
        if weight is not None and weight.device.type == "meta":
            kept = self.__dict__.setdefault(ADAPTER_INIT_ATTRIBUTE, {})
            for attribute in self.adapter_layer_names:
                container = getattr(self, attribute, None)
                if not isinstance(container, torch.nn.ModuleDict) or adapter_name not in container:
                    continue
                for name, param in container[adapter_name].named_parameters():
                    if param.device.type != "meta":
                        kept[f"{attribute}.{adapter_name}.{name}"] = param.detach().to(weight.dtype).clone()
        return original(self, adapter_name, device)

    LoraLayer._move_adapter_to_device_of_base_layer = move_keeping_values
    try:
        yield
    finally:
        LoraLayer._move_adapter_to_device_of_base_layer = original


def checkpoint_keys(folder: str) -> set[str]:
    """Tensor names in the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file to load sharded (FSDP loads weights with "
                                "torch.distributed.checkpoint's HuggingFaceStorageReader)")
    keys = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def checkpoint_name(parameter_name: str) -> str | None:
    """The safetensors name of a (possibly peft-wrapped) parameter; None for an adapter."""
    from distlab.runtime.lora import base_name

    return base_name(parameter_name)


class DCPShards(ShardedLoad):
    """FSDP2's placement (steps 1-4 of the module docstring): DCP's HuggingFaceStorageReader
    reads each rank's slices of the stored tensors straight into its DTensor shards."""

    loader = "FSDP"
    otherwise = "LoRA adapters"

    def __init__(self, model, folder: str, device: torch.device):
        super().__init__(model, folder)
        self.device = device
        self.buffers = {name: b.detach().clone() for name, b in model.named_buffers() if b.device.type != "meta"}
        self.adapters = {f"{module_name}.{key}": value for module_name, module in model.named_modules()
                         for key, value in module.__dict__.get(ADAPTER_INIT_ATTRIBUTE, {}).items()}
        available = checkpoint_keys(folder)
        names = {name: checkpoint_name(name) for name, _ in model.named_parameters()}
        self.keys = {name: key for name, key in names.items() if key is not None and key in available}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, value in self.buffers.items():
                model.get_buffer(name).copy_(value)

    def stored(self):
        return self.keys

    def filled_otherwise(self):
        return set(self.adapters)

    def load_layer(self, names, params):
        # One read per decoder layer (and one for the rest): the reader's transient buffers hold
        # one layer's slices at a time, not the rank's whole shard.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        with torch.no_grad():
            dcp.load({self.keys[name]: params[name] for name in names},
                     storage_reader=HuggingFaceStorageReader(self.folder))
        return 0  # DCP does not say what it read

    def finish(self, bytes_read):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.adapters:
            set_model_state_dict(self.model, {k: v.to(self.device) for k, v in self.adapters.items()},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        return {"how": "meta-device model, fully_shard, to_empty, then torch.distributed.checkpoint "
                       "HuggingFaceStorageReader reading each rank's slices of the safetensors",
                "checkpoint_tensors_loaded": len(self.keys), "lora_adapters_restored": len(self.adapters),
                "buffers_restored": sorted(self.buffers)}


def materialize_sharded(model, folder: str, device: torch.device) -> dict:
    """Steps 1-4 of the module docstring on an already fully_shard-ed meta model."""
    return DCPShards(model, folder, device).run()
