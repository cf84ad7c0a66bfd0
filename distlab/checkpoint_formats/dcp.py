"""Sharded checkpoints with torch.distributed.checkpoint (DCP), for every strategy whose ranks
hold different pieces of the model (FSDP2, tensor parallel, pipeline parallel): each rank writes
its own shards of the trainable parameters and the optimizer, and reads them back into the same
layout."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from distlab.checkpoint_formats import read_format, write_format

DCP_FORMAT = "dcp"


def _dcp_options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened optimizer state: keys per parameter name ("param_groups.<fqn>.lr"). Nested
    # param_groups lists would collide across pipeline stages, whose groups hold different
    # parameters, and DCP keeps only one rank's copy of a duplicated key.
    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


def _trainable_state(strategy):
    """(model state, optimizer state, whether frozen weights were left out): the model part
    holds the trainable parameters only (LoRA: the adapters; the frozen base is named by
    identity in the checkpoint's metadata, distlab.checkpoints.checkpoint)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from distlab.checkpoint_formats import trainable_names

    model_state, optim_state = get_state_dict(strategy.model, strategy.optimizer, options=_dcp_options())
    trained = trainable_names(strategy.model)
    kept = {k: v for k, v in model_state.items() if k in trained}
    return kept, optim_state, len(kept) < len(model_state)


def dcp_save(strategy, path: str) -> None:
    """Each rank writes its own shards of the trainable parameters and the optimizer
    (torch.distributed.checkpoint); written to a temporary folder and renamed by rank 0, so a
    killed save leaves no checkpoint. Collective: whatever failed on a rank, every rank reaches
    the same collectives and raises the same SaveFailed (on_every_rank; DCP's own save gathers
    each rank's write error and raises it on every rank)."""
    import torch.distributed.checkpoint as dcp

    from distlab.checkpoints.checkpoint import on_every_rank
    from distlab.records.checkpoint_files import atomic_dir

    model_state, optim_state, _ = _trainable_state(strategy)
    tmp, commit = Path(str(path) + ".tmp"), None

    def make_folder():
        nonlocal tmp, commit
        tmp, commit = atomic_dir(path)

    # The temporary folder exists before anyone writes into it.
    on_every_rank(make_folder if dist.get_rank() == 0 else None, "the temporary folder (rank 0)")
    on_every_rank(lambda: dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp)),
                  "torch.distributed.checkpoint's write")

    def name_and_commit():
        write_format(tmp, {"format": DCP_FORMAT, "strategy": strategy.name, "world_size": dist.get_world_size()})
        commit()

    on_every_rank(name_and_commit if dist.get_rank() == 0 else None, "the format file and rename (rank 0)")


def dcp_load(strategy, path: str) -> None:
    """Load a dcp_save folder into the already wrapped model and optimizer (same layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    read_format(path, DCP_FORMAT)
    model_state, optim_state, partial = _trainable_state(strategy)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    # LoRA: the frozen base keeps the weights it was loaded with (its identity was checked).
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_dcp_options(strict=not partial))
