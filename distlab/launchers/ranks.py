"""Start N ranks of a module on this machine and wait for them: the one service training
(the torchrun and accelerate launchers), checkpoint validation (distlab.jobs.validate) and the
collective benchmark (distlab.tools.collectives) start their ranks through, so every process
distlab starts obeys the same rules:
- threads and GPUs: the rank environment (distlab.launchers.environment): OMP_NUM_THREADS per
  rank, no GPU visible to a CPU spec, else the GPUs the caller holds (distlab.jobs.launch.assigned_gpus);
- rendezvous on loopback only: torchrun or accelerate launch through distlab.launchers.loopback;
- hygiene: the launcher asks for SIGKILL when its caller dies (PR_SET_PDEATHSIG), and its
  whole tree is killed on a timeout, an error or a signal (distlab.launchers.process.run_tree);
  each rank module calls die_with_parent(same_launch=True) first;
- logs: the `$ ...` line that started them, without this checkout's paths, then their output.
It is also training's torchrun and accelerate launcher (run, in distlab.launchers.REGISTRY).
Ray (its driver and workers) and links (one torchrun agent per host namespace) build other
commands and run them through the same process handling (run_ranks, run_trees).
"""
from __future__ import annotations

from pathlib import Path

from distlab.records.spec import Spec
from distlab.records.job import Job
from distlab.launchers.accelerate import accelerate_command, launch_environment, write_accelerate_config
from distlab.launchers.environment import single_node_environment
from distlab.launchers.process import run_ranks
from distlab.launchers.torchrun import torchrun_command
from distlab.records.run_layout import run_files_dir


def rank_command(spec: Spec, module: str, args: list[str], marker: str, run_dir=None) -> tuple[list[str], dict]:
    """The command and environment that start spec.world_size ranks of `module`: accelerate
    launch for an experiment Accelerate launched (its config file, written from the spec into
    run_dir's run_files/, is the one the launch reads), else torchrun (a Ray-launched experiment's
    validation too: the same process group)."""
    if spec.launcher == "accelerate":
        config = write_accelerate_config(spec, run_files_dir(run_dir), marker)
        return accelerate_command(str(config), module, *args), launch_environment(spec)
    return torchrun_command(spec.world_size, module, *args), single_node_environment(spec)


def start_ranks(spec: Spec, module: str, args: list[str], marker: str | Path, log_path: str | None,
                timeout: float | None, run_dir=None, what: str = "training ranks", check: bool = True) -> int | None:
    """Run `module`'s ranks (rank_command) to completion. marker: the launch's job file (or the
    output it writes), whose path names every process of the launch (distlab.launchers.process).
    check: a failure or the timeout raises naming `what`; else the status is returned (None:
    killed at the timeout, which the log says)."""
    cmd, env = rank_command(spec, module, args, str(marker), run_dir)
    return run_ranks(cmd, env, log_path, timeout, marker=str(marker), what=what, check=check)


def run(job: Job, job_path: str, log_path: str | None, timeout: float | None) -> None:
    """The torchrun and accelerate launchers: the experiment's ranks of distlab.rank.worker."""
    spec = job.spec
    if spec.link:  # one agent per host namespace instead (torchrun only: distlab.configuration.config_links)
        from distlab.launchers import linked

        linked.run(job, job_path, log_path, timeout)
        return
    if spec.rank_cpu_budget:  # the ranks' cpu cgroups: empty ones of earlier runs go first
        from distlab.configuration.cpu_budget import sweep

        sweep()
    try:
        start_ranks(spec, "distlab.rank.worker", ["--job", job_path], job_path, log_path, timeout,
                    run_dir=job.run_dir)
    finally:
        if spec.rank_cpu_budget:
            sweep()
