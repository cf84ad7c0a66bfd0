"""Checkpoint loading that cannot execute code from the checkpoint.

Three loaders distlab calls would unpickle arbitrary objects if left alone: DeepSpeed's
`TorchCheckpointEngine.load` calls `torch.load(weights_only=False)`, torch's own DCP reader
`pickle.load`s the `.metadata` file, and DCP's default planner `torch.load(weights_only=False)`s
every non-tensor item. `weights_only_loads()` runs a loader with torch.load forced to
weights_only=True and DCP's pickle.load replaced by a restricted unpickler: both build only
tensors, containers, primitives and the few allow-listed data classes below (no call of an
unknown global, so a planted pickle raises `UnpicklingError` instead of running).
"""
from __future__ import annotations

import contextlib
import io
import pickle
import sys
import types


def _deepspeed_globals() -> list:
    """Plain data classes DeepSpeed writes into its checkpoints (enum, loss-scaler state, the
    fragment map of ZeRO-1/2 optimizer partitions), when DeepSpeed is loaded: only DeepSpeed's
    engine reads a DeepSpeed checkpoint, so a process without it has none to read. Importing it
    here for every other strategy's load cost each checkpoint validation ~1 s of CPU (DeepSpeed
    imports MLflow for its autotuner)."""
    out = []
    if "deepspeed" not in sys.modules:
        return out
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]
    except ImportError:  # DeepSpeed absent: nothing of it to load
        pass
    return out


def _dcp_globals() -> list:
    from torch.distributed.checkpoint import metadata as m

    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    out = [getattr(m, n) for n in names if hasattr(m, n)]
    from torch.distributed.checkpoint import filesystem

    out += [filesystem._StorageInfo] if hasattr(filesystem, "_StorageInfo") else []
    import pathlib

    return out + [pathlib.PosixPath, pathlib.PurePosixPath]  # StorageMeta.checkpoint_id


def _safe_globals() -> list:
    import collections

    import torch

    return [collections.OrderedDict, torch.Size, torch.memory_format,
            *_deepspeed_globals(), *_dcp_globals()]


class _RestrictedUnpickler(pickle.Unpickler):
    """Python's documented "restricting globals" unpickler: only DCP's metadata classes,
    torch.Size and torch dtypes may be named (DCP writes .metadata with pickle protocol 4+,
    which torch's weights-only unpickler does not read)."""

    def find_class(self, module, name):
        import torch

        allowed = {(c.__module__, c.__qualname__): c for c in _safe_globals()}
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # maps "torch.strided" to the layout
            return torch.serialization._get_layout
        if (module, name) == ("builtins", "getattr"):  # an enum member, as some Python releases pickle one
            return _allowed_enum_member
        raise pickle.UnpicklingError(f"checkpoint pickle names {module}.{name}, which is not plain checkpoint "
                                     "data; refusing to load it (distlab.checkpoints.safe_load)")


def _allowed_enum_member(cls, name):
    """getattr(EnumClass, "MEMBER") for an allow-listed enum only: Python 3.11.2 pickles DCP's
    _MEM_FORMAT_ENCODING members that way (3.11.7 by value), so a plain getattr would otherwise be
    the one callable a checkpoint may name. Anything else is refused."""
    import enum

    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in _safe_globals()
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise pickle.UnpicklingError(f"checkpoint pickle calls getattr({getattr(cls, '__name__', cls)!r}, {name!r}), "
                                 "which is not an allow-listed enum member; refusing to load it "
                                 "(distlab.checkpoints.safe_load)")


def _restricted_pickle_load(file, *args, **kwargs):
    return _RestrictedUnpickler(file).load()


def _restricted_pickle_loads(data, *args, **kwargs):
    return _RestrictedUnpickler(io.BytesIO(data)).load()


@contextlib.contextmanager
def weights_only_loads():
    """Inside: every torch.load is weights_only=True and DCP's metadata pickle is read by the
    weights-only unpickler, with DeepSpeed's and DCP's own data classes allow-listed."""
    import torch
    from torch.distributed.checkpoint import filesystem

    original_load, original_pickle = torch.load, filesystem.pickle

    def forced_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original_load(*args, **kwargs)

    torch.load = forced_load
    filesystem.pickle = types.SimpleNamespace(load=_restricted_pickle_load, dump=original_pickle.dump,
                                              dumps=original_pickle.dumps, loads=_restricted_pickle_loads)
    try:
        # torch's weights-only unpickler takes (object, name) pairs: a pickle naming builtins.getattr
        # gets the enum-member resolver (DeepSpeed's ZeroStageEnum under Python 3.11.2).
        with torch.serialization.safe_globals(_safe_globals() + [(_allowed_enum_member, "builtins.getattr")]):
            yield
    finally:
        torch.load, filesystem.pickle = original_load, original_pickle
