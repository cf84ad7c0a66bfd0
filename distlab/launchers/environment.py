"""The one place a rank's environment is built (every launcher starts from it)."""
from __future__ import annotations

import os

from distlab.records.spec import Spec
from distlab.launchers import warm_start

BASE_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",  # nothing downloads at run time; a missing file is an error
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # CUDA's availability asked through NVML, which does not initialise CUDA (a process that forks
    # stays safe to fork). DeepSpeed's import sets it in its own process (os.environ.setdefault),
    # and transformers' save_pretrained imports DeepSpeed through Accelerate: set here for every
    # process distlab starts and for the warm-start server, a rank's value never differs from the
    # server's by which library it imported first (distlab.launchers.warm_checks refuses that).
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


# Fault-injection hook for tests: "<experiment id>:<rank>:<steps done>" SIGKILLs that rank
# right after that step (and after any checkpoint saved at it: distlab.checkpoints.checkpoint).
# Every launcher passes it on to its ranks.
FAULT_ENV = "DISTLAB_FAULT_KILL"


# A CPU experiment's ranks: DeepSpeed's CPU accelerator, and no GPU touched by accident.
CPU_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def cuda_rank_threads(spec: Spec) -> int:
    """CPU threads of one CUDA rank: the job's cores (DISTLAB_JOB_THREADS, Snakemake's
    `threads` of the job, set by distlab.jobs.rule_log) split evenly over its ranks, at least 1.
    torchrun's default of 1 thread starves the host-side work of a GPU rank (ZeRO offload's
    CPU Adam, the validation's CPU logits). Outside Snakemake: cpu_threads_per_rank."""
    job_threads = os.environ.get("DISTLAB_JOB_THREADS")
    if not job_threads:
        return spec.cpu_threads_per_rank
    return max(1, int(job_threads) // spec.world_size)


def rank_environment(spec: Spec) -> dict:
    env = dict(os.environ)
    env.update(BASE_ENV)
    # CPU: a "device" is cpu_threads_per_rank cores; CUDA: the job's cores split over its ranks.
    env["OMP_NUM_THREADS"] = str(spec.cpu_threads_per_rank if spec.device == "cpu" else cuda_rank_threads(spec))
    if spec.device == "cpu":
        env.update(CPU_ENV)
    # Warm starts are for CPU ranks in this machine's own namespaces: a GPU rank's start is a small
    # part of its run, and a link's rank runs in a host namespace the server's copy would not be in.
    if spec.device != "cpu" or spec.link:
        env.pop(warm_start.SOCKET_ENV, None)
    return env


def warm_start_environment() -> dict:
    """The environment the run's warm-start server imports under (distlab.launchers.warm_start):
    a CPU rank's, less what each launch sets."""
    env = {**os.environ, **BASE_ENV, **CPU_ENV}
    env.pop(warm_start.SOCKET_ENV, None)
    env.pop(warm_start.LAUNCH_ENV, None)  # a copy's launch is the one its server records, never the server's own
    return env


def single_node_environment(spec: Spec) -> dict:
    """A rank's environment for a launch on this machine alone (torchrun, accelerate launch):
    its gloo/NCCL sockets on the loopback interface (distlab.launchers.loopback)."""
    from distlab.launchers import loopback

    return {**rank_environment(spec), **loopback.environment()}
