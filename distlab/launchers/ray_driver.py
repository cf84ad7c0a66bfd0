"""The `ray` launcher: the ranks of distlab.rank.worker.run_rank run as Ray Train v2 workers. This
module starts the driver process (distlab.rank.ray_train, by name, in the job's private Ray
instance or against the configured cluster); the workers' side is distlab.rank.ray_worker, the
record of where each rank ran distlab.launchers.ray_record.

`TorchTrainer` places one worker per rank and sets up the torch process group (gloo on
CPU, nccl on GPU); Strategy.init_distributed finds it initialized and joins it. The loop
and the checkpoint format are the ones torchrun runs use; the `ray` launcher adds what Ray
brings: every checkpoint is reported with `ray.train.report`, a restarted worker group
(FailureConfig max_failures, or an elastic resize with ScalingConfig(num_workers=(min,
max))) resumes from `ray.train.get_checkpoint()`, and where each rank ran is recorded.

What comes back to this machine, and how:
- metrics and per-step rows: rank 0's training function returns them; Ray hands them to
  the driver (`Result.return_value`), which writes metrics.json and steps.jsonl. No
  shared filesystem needed.
- events (worker groups, node and pid of each rank, checkpoints, injected faults): a
  `RunLog` actor the driver owns; workers send it records. No shared filesystem needed.
- checkpoints: the ranks write them into the run folder (resume/, checkpoint/final), the
  same collective format torchrun runs write, so every node must see the run folder (one
  machine; NFS; a KubeRay volume claim). Ray keeps its own copies of the periodic ones in
  `ray.storage_path` (default <run dir>/ray, removed after a successful run).
- inputs (prepared data, base model) are read by path: the same paths on every node.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from distlab.records.spec import Spec
from distlab.records.job import Job
from distlab.launchers.environment import rank_environment
from distlab.launchers.process import run_ranks
from distlab.launchers.ray_nodes import token_auth_environment

PRIVATE_TEMP_DIR_ENV = "DISTLAB_RAY_TEMP_DIR"


def resolve_address(spec: Spec) -> str | None:
    """None = start a local Ray instance for this job; "env" = $RAY_ADDRESS (must be set)."""
    address = spec.ray["address"]
    if address == "env":
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise RuntimeError("ray.address is 'env' but RAY_ADDRESS is not set in the environment")
    return address


def private_instance_environment(folder: str) -> dict:
    """Token auth stays on for a job's private Ray instance, but its token lives in the
    instance's temp dir (mode 600) instead of ~/.ray: a fresh CI box may have no writable
    home, and concurrent jobs must not race on one token file. Ray reads these at import,
    so they go into the driver's environment before it starts."""
    return {**token_auth_environment(folder), PRIVATE_TEMP_DIR_ENV: folder,
            # A job's own instance has no node a cloud could preempt: skip the watcher process.
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def run(job: Job, job_path: str, log_path: str | None, timeout: float | None) -> None:
    """LAUNCHERS entry: the Ray driver (distlab.rank.ray_train) runs in its own process, started by
    name as torchrun's ranks are, its output in the job's log."""
    env = rank_environment(job.spec)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    # The two-host run (distlab/jobs/two_hosts.py) starts the driver inside the head's namespace:
    # job.driver_inside is that command prefix (nsenter ...); the head is reachable only there.
    command = list(job.driver_inside) + [sys.executable, "-m", "distlab.rank.ray_train", "--job", job_path]
    if resolve_address(job.spec):
        run_ranks(command, env, log_path, timeout, marker=job_path)
        return
    # A short private temp dir: concurrent jobs never share a Ray session, and unix socket
    # paths stay under the OS length limit.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        env.update(private_instance_environment(temp_dir))
        run_ranks(command, env, log_path, timeout, marker=job_path)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
