"""The `torchrun` launcher, and the one place its command line is built.

Single node, loopback only: torch's static rendezvous with its store on 127.0.0.1, port 0
(the OS picks a free port when the store binds, so concurrent Snakemake jobs never share
one; distlab.launchers.loopback); `--max-restarts=0`: a failed rank fails the job.
"""
from __future__ import annotations

import sys

from distlab.launchers import loopback
from distlab.launchers.environment import single_node_environment
from distlab.launchers.process import run_ranks


def torchrun_command(world_size: int, module: str, *args: str) -> list[str]:
    """`torchrun --nproc-per-node <world_size> -m <module> <args>` on this machine."""
    return [sys.executable, "-m", "distlab.launchers.loopback", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={world_size}", *loopback.launcher_args(), "--max-restarts=0", "-m", module, *args]


def run(job: dict, job_path: str, log_path: str | None, timeout: float | None) -> None:
    spec = job["spec"]
    if spec.get("link"):  # one agent per host namespace instead (distlab.launchers.linked)
        from distlab.launchers import linked

        linked.run(job, job_path, log_path, timeout)
        return
    if spec.get("rank_cpu_budget"):  # the ranks' cpu cgroups: empty ones of earlier runs go first
        from distlab.cpu_budget import sweep

        sweep()
    try:
        run_ranks(torchrun_command(spec["world_size"], "distlab.worker", "--job", job_path),
                  single_node_environment(spec), log_path, timeout, marker=job_path)
    finally:
        if spec.get("rank_cpu_budget"):
            sweep()
