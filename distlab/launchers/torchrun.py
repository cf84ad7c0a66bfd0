"""torchrun's command line, built in this one place (the torchrun launcher is
distlab.launchers.ranks, which starts training's, validation's and the collective benchmark's
ranks with it).

Single node, loopback only: torch's static rendezvous with its store on 127.0.0.1, port 0
(the OS picks a free port when the store binds, so concurrent Snakemake jobs never share
one; distlab.launchers.loopback); `--max-restarts=0`: a failed rank fails the job.
"""
from __future__ import annotations

import sys

from distlab.launchers import loopback


def torchrun_command(world_size: int, module: str, *args: str) -> list[str]:
    """`torchrun --nproc-per-node <world_size> -m <module> <args>` on this machine."""
    return [sys.executable, "-m", "distlab.launchers.loopback", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={world_size}", *loopback.launcher_args(), "--max-restarts=0", "-m", module, *args]

