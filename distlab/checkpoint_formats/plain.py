"""The plain format, for strategies whose every rank holds the whole model (DDP): rank 0 writes
the trainable parameters (safetensors) and the optimizer state; every rank reads the same files,
so the format does not depend on the world size."""
from __future__ import annotations

from pathlib import Path

from distlab.checkpoint_formats import write_format

PLAIN_FORMAT = "plain"


def save_plain(strategy, path: str) -> None:
    """Rank 0 writes the trainable parameters (safetensors, one tensor at a time: a CPU one
    straight from the live tensor, a CUDA one through its host copy) and the optimizer state;
    others wait. Collective: a failed write is SaveFailed on every rank (on_every_rank)."""
    import torch
    import torch.distributed as dist

    from distlab.checkpoints.checkpoint import on_every_rank
    from distlab.records.checkpoint_files import atomic_dir
    from distlab.records.export_files import SafetensorsFile
    from distlab.checkpoint_formats import trainable_names
    from distlab.runtime.streamed import host

    def write():
        tmp, commit = atomic_dir(path)
        module = strategy.unwrapped()
        trained = trainable_names(module)
        params = {n: p.detach() for n, p in module.named_parameters() if n in trained}
        out = SafetensorsFile(tmp / "model.safetensors", {n: (tuple(p.shape), p.dtype) for n, p in params.items()},
                              {"format": "pt"})
        for name, value in params.items():
            out.write(name, host(value))
        out.close()
        torch.save(strategy.optimizer.state_dict(), tmp / "optimizer.pt")
        write_format(tmp, {"format": PLAIN_FORMAT, "strategy": strategy.name, "frozen_parameters_saved": False})
        commit()

    on_every_rank(write if dist.get_rank() == 0 else None, "the plain format's write (rank 0)")


def load_plain(strategy, path: str) -> None:
    """Every rank reads the same files. The file must hold exactly the trainable parameters
    (the frozen ones keep the base's values)."""
    import torch
    from safetensors.torch import load_file

    from distlab.checkpoints.checkpoint import CheckpointMismatch
    from distlab.checkpoint_formats import trainable_names

    path = Path(path)
    module = strategy.unwrapped()
    state = load_file(str(path / "model.safetensors"))
    expected = trainable_names(module)
    if set(state) != expected:
        raise CheckpointMismatch(f"{path / 'model.safetensors'} holds {len(state)} tensors, this model trains "
                                 f"{len(expected)}: e.g. {sorted(set(state) ^ expected)[:3]}")
    module.load_state_dict(state, strict=False)
    # Read into host memory: a checkpoint saved on a GPU machine tags its tensors cuda:N, which a
    # CPU-only machine cannot place; load_state_dict then casts each state tensor to its parameter's
    # device, on a GPU machine too.
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    strategy.optimizer.load_state_dict(optimizer)
