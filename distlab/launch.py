"""Start the ranks of one experiment with the launcher its spec names.

torchrun: `--rdzv-endpoint localhost:0` lets the OS pick a free port, so concurrent
Snakemake jobs never fight over a master port. Launchers other than torchrun (accelerate
launch, Ray) register themselves in LAUNCHERS.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

BASE_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",  # nothing downloads at run time; a missing file is an error
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def rank_environment(spec: dict) -> dict:
    env = dict(os.environ)
    env.update(BASE_ENV)
    from distlab.gpu_alloc import cuda_rank_threads

    env["OMP_NUM_THREADS"] = str(spec["cpu_threads_per_rank"] if spec["device"] == "cpu" else cuda_rank_threads(spec))
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU experiment must not touch a GPU by accident
    return env


def torchrun_command(spec: dict, job_path: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc-per-node={spec['world_size']}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
            "--max-restarts=0", "-m", "distlab.worker", "--job", job_path]


def _run(cmd: list[str], env: dict, log_path: str | None, timeout: float | None) -> None:
    log = open(log_path, "a") if log_path else None
    try:
        if log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
        proc = subprocess.run(cmd, env=env, stdout=log or None, stderr=subprocess.STDOUT if log else None,
                              timeout=timeout)
    finally:
        if log:
            log.close()
    if proc.returncode != 0:
        tail = ""
        if log_path:
            tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"training ranks exited with status {proc.returncode}; last log lines:\n{tail}")


def run_torchrun(job: dict, job_path: str, log_path: str | None, timeout: float | None) -> None:
    _run(torchrun_command(job["spec"], job_path), rank_environment(job["spec"]), log_path, timeout)


from distlab.launchers_accelerate import run_accelerate  # noqa: E402  (accelerate launch, its own module)

from distlab.ray_launcher import run_ray  # noqa: E402  (Ray Train driver, its own module)

LAUNCHERS = {"torchrun": run_torchrun, "accelerate": run_accelerate, "ray": run_ray}


def write_job(job: dict) -> str:
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.json"
    path.write_text(json.dumps(job, indent=1))
    return str(path)


def write_oom_metrics(job: dict) -> bool:
    """Turn the ranks' oom-rank<N>.json into a metrics.json with status 'oom'."""
    from distlab.metrics import METRICS_SCHEMA_VERSION, library_versions

    run_dir = Path(job["run_dir"])
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("oom-rank*.json"))]
    if not records:
        return False
    hardware = json.loads(Path(job["hardware_json"]).read_text())
    spec = job["spec"]
    metrics = {"schema_version": METRICS_SCHEMA_VERSION, "experiment": spec["id"], "stage": spec["stage"],
               "machine": hardware["machine"], "status": "oom", "spec": spec, "oom": records,
               "memory_budget_gib": spec["memory_budget_gib"], "versions": library_versions()}
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (run_dir / "steps.jsonl").write_text("")
    return True


@contextlib.contextmanager
def assigned_gpus(job: dict):
    """CUDA runs hold their own disjoint GPUs (distlab.gpu_alloc) while the ranks run; every
    launcher's rank environment inherits CUDA_VISIBLE_DEVICES, and devices.json records it."""
    spec = job["spec"]
    # On an existing Ray cluster, Ray places the ranks and assigns their GPUs.
    if spec["device"] != "cuda" or (spec.get("launcher") == "ray" and spec.get("ray", {}).get("address")):
        yield None
        return
    from distlab.gpu_alloc import allocate

    lock_dir = job.get("gpu_lock_dir") or os.environ.get("DISTLAB_GPU_LOCK_DIR") or \
        str(Path(job["run_dir"]).resolve().parent.parent / ".gpu-locks")
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    with allocate(spec["world_size"], lock_dir) as ids:
        Path(job["run_dir"], "devices.json").write_text(json.dumps(
            {"cuda_visible_devices": ids, "inherited": previous, "lock_dir": lock_dir,
             "how": "exclusive fcntl locks, one per GPU, held while the ranks ran (distlab.gpu_alloc)"}))
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        try:
            yield ids
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous


def launch(job: dict, log_path: str | None = None, timeout: float | None = None) -> str:
    """Run the experiment; returns its status ('ok' or 'oom'). Any other failure raises."""
    launcher = job["spec"]["launcher"]
    if launcher not in LAUNCHERS:
        raise NotImplementedError(f"launcher '{launcher}' is not implemented in this version of distlab "
                                  f"(available: {sorted(LAUNCHERS)})")
    job_path = write_job(job)
    for stale in Path(job["run_dir"]).glob("oom-rank*.json"):
        stale.unlink()
    try:
        with assigned_gpus(job):
            LAUNCHERS[launcher](job, job_path, log_path, timeout)
    except RuntimeError:
        if write_oom_metrics(job):
            return "oom"
        raise
    metrics = Path(job["run_dir"]) / "metrics.json"
    if not metrics.is_file():
        raise RuntimeError(f"the ranks exited cleanly but wrote no {metrics}")
    return "ok"
