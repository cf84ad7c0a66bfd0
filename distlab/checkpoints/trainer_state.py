"""A rank's trainer state inside a checkpoint (trainer/): steps done, data position
(epoch, position), RNG, the LR schedule's state and the per-step records, as JSON +
safetensors (nothing unpickled).

The indices each step read are not stored (they grow with steps x batch): a restore re-draws
them from the seeded sampler and checks it lands on the saved data position.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from distlab.errors import CheckpointMismatch

if TYPE_CHECKING:  # the annotations' only use; a rank imports torch where it runs
    import torch


def save_trainer_state(root: Path, rank: int, device: torch.device, steps_done: int, stream, records,
                       scheduler=None) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    folder = root / "trainer"
    folder.mkdir(exist_ok=True)
    rng = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(device)
    save_file(rng, str(folder / f"rng-rank{rank}.safetensors"))
    np_state = np.random.get_state()
    # The data position is (epoch, position); the indices each step read are not stored (they
    # would grow with steps x batch): the restore replays them from the seeded sampler.
    compact = [{k: v for k, v in rec.items() if k != "samples"} for rec in records]
    state = {"rank": rank, "steps_done": steps_done, "stream": stream.state(), "records": compact,
             "python_random": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
             "numpy_random": [np_state[0], np_state[1].tolist(), *map(float, np_state[2:])]}
    if scheduler is not None:  # the LR schedule's position (LambdaLR state: numbers and lists only)
        state["lr_scheduler"] = scheduler.state_dict()
    (folder / f"rank{rank}.json").write_text(json.dumps(state))


def restore_trainer_state(root: Path, rank: int, device: torch.device, stream, scheduler=None) -> tuple[int, list]:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    folder = root / "trainer"
    state = json.loads((folder / f"rank{rank}.json").read_text())
    rng = load_file(str(folder / f"rng-rank{rank}.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in rng:
        torch.cuda.set_rng_state(rng["torch_cuda"], device)
    version, internal, gauss = state["python_random"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy_random"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    if scheduler is not None and "lr_scheduler" in state:
        scheduler.load_state_dict(state["lr_scheduler"])
    records = replay_samples(stream, state["records"])
    if stream.state() != state["stream"]:
        raise CheckpointMismatch(f"checkpoint {root}: replaying {len(records)} steps of the sampler ends at "
                                 f"{stream.state()}, the saved data position is {state['stream']}")
    return state["steps_done"], records


def replay_samples(stream, records: list) -> list:
    """Records with the indices each step read, re-drawn from the stream's start (same seed,
    sampler and world size); leaves the stream where the last recorded step left it."""
    stream.restore({"epoch": 0, "position": 0})
    out = []
    for rec in records:
        samples = [i for _ in range(stream.spec.grad_accum) for i in stream.next()]
        out.append({**rec, "samples": samples})
    return out
