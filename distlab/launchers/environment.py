"""The one place a rank's environment is built (every launcher starts from it)."""
from __future__ import annotations

import os

BASE_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",  # nothing downloads at run time; a missing file is an error
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def rank_environment(spec: dict) -> dict:
    env = dict(os.environ)
    env.update(BASE_ENV)
    from distlab.jobs.gpu_alloc import cuda_rank_threads

    # CPU: a "device" is cpu_threads_per_rank cores; CUDA: the job's cores split over its ranks.
    env["OMP_NUM_THREADS"] = str(spec["cpu_threads_per_rank"] if spec["device"] == "cpu" else cuda_rank_threads(spec))
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU experiment must not touch a GPU by accident
    return env


def single_node_environment(spec: dict) -> dict:
    """A rank's environment for a launch on this machine alone (torchrun, accelerate launch):
    its gloo/NCCL sockets on the loopback interface (distlab.launchers.loopback)."""
    from distlab.launchers import loopback

    return {**rank_environment(spec), **loopback.environment()}
