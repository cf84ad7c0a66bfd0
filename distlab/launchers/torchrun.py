"""torchrun's command line, built in this one place (the torchrun launcher is
distlab.launchers.ranks, which starts training's, validation's and the collective benchmark's
ranks with it).

Single node, loopback only: torch's static rendezvous with its store on 127.0.0.1, port 0
(the OS picks a free port when the store binds, so concurrent Snakemake jobs never share
one; distlab.launchers.loopback); `--max-restarts=0`: a failed rank fails the job.
"""
from __future__ import annotations


from distlab.launchers import loopback
from distlab.launchers.entry import entry_command, entry_target


def _loopback_torchrun(world_size: int, *target: str) -> list[str]:
    return entry_command("distlab.launchers.loopback", "torch.distributed.run", "--nnodes=1",
                         f"--nproc-per-node={world_size}", *loopback.launcher_args(), "--max-restarts=0", *target)


def torchrun_command(world_size: int, module: str, *args: str) -> list[str]:
    """`torchrun --nproc-per-node <world_size> -m <module> <args>` on this machine."""
    return _loopback_torchrun(world_size, *entry_target(module, *args))


def torchrun_script_command(world_size: int, script: str, *args: str) -> list[str]:
    """The same launch of a script file (the benchmarks' hand-written loops, a test's own
    ranks): a plain `torchrun` would listen on every interface. Its ranks need
    loopback.environment() too, so that gloo's sockets stay on the loopback interface."""
    return _loopback_torchrun(world_size, str(script), *args)

