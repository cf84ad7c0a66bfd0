"""GPU device ids for concurrent jobs: disjoint sets, released when a job dies, recorded in
the run. Fake device lists stand in for GPUs; the locking is the real thing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from distlab.jobs.gpu_alloc import GpuAllocationError, allocate, visible_devices
from distlab.records.spec import Spec

HOLDER = """
import json, sys, time
from distlab.jobs.gpu_alloc import allocate
lock_dir, n, devices, hold, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), float(sys.argv[4]), sys.argv[5]
with allocate(n, lock_dir, devices=devices, timeout=60, poll=0.05) as ids:
    start = time.time()
    print("HELD", ",".join(ids), flush=True)
    time.sleep(hold)
    end = time.time()
json.dump({"ids": ids, "start": start, "end": end}, open(out, "w"))
"""


def holder(tmp_path, name, n, devices, hold):
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "locks"), str(n), ",".join(devices),
                             str(hold), str(out)], stdout=subprocess.PIPE, text=True)
    return proc, out


@pytest.mark.slow
def test_concurrent_jobs_get_disjoint_gpus(tmp_path):
    devices = ["0", "1", "2", "3"]
    jobs = [holder(tmp_path, f"job{i}", 2, devices, 1.0) for i in range(4)]
    for proc, _ in jobs:
        assert proc.wait(timeout=120) == 0
    held = [json.loads(out.read_text()) for _, out in jobs]
    for i, a in enumerate(held):
        assert len(set(a["ids"])) == 2 and set(a["ids"]) <= set(devices)
        for b in held[i + 1:]:
            overlapped = a["start"] < b["end"] and b["start"] < a["end"]
            if overlapped:
                assert not set(a["ids"]) & set(b["ids"]), (a, b)
    # 4 jobs of 2 GPUs on a 4-GPU box: never more than two at once, so some had to wait.
    assert max(sum(h["start"] <= t["start"] < h["end"] for h in held) for t in held) <= 2


@pytest.mark.slow
def test_a_killed_job_releases_its_gpus(tmp_path):
    proc, _ = holder(tmp_path, "victim", 2, ["0", "1"], 600)
    assert proc.stdout.readline().startswith("HELD")
    with pytest.raises(GpuAllocationError, match="no 1 free GPU"):
        with allocate(1, str(tmp_path / "locks"), devices=["0", "1"], timeout=0.3, poll=0.05):
            pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with allocate(2, str(tmp_path / "locks"), devices=["0", "1"], timeout=5) as ids:
        assert sorted(ids) == ["0", "1"]


def test_a_job_needing_more_gpus_than_exist_fails_clearly(tmp_path):
    with pytest.raises(GpuAllocationError, match="needs 4 GPU"):
        with allocate(4, str(tmp_path), devices=["0", "1"]):
            pass


def test_an_inherited_device_list_is_all_a_job_may_use(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # e.g. what Slurm gave the job
    assert visible_devices(count=8) == ["5", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_devices(count=3) == ["0", "1", "2"]


def test_a_cuda_run_holds_its_gpus_while_the_ranks_run_and_records_them(tmp_path, monkeypatch):
    from distlab.jobs.launch import assigned_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,6")  # fake devices: nothing here touches a GPU
    run_dir = tmp_path / "results" / "box" / "exp"
    run_dir.mkdir(parents=True)
    with assigned_gpus(Spec({"device": "cuda", "world_size": 2}), str(run_dir)) as ids:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(ids) and len(ids) == 2
        with pytest.raises(GpuAllocationError):  # a concurrent 2-GPU job must wait
            with allocate(2, str(tmp_path / "results" / ".gpu-locks"), devices=["2", "3", "6"], timeout=0.2):
                pass
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3,6"
    recorded = json.loads((run_dir / "devices.json").read_text())
    assert recorded["cuda_visible_devices"] == ids and recorded["inherited"] == "2,3,6"


def test_a_cpu_run_takes_no_gpu(tmp_path):
    from distlab.jobs.launch import assigned_gpus

    with assigned_gpus(Spec({"device": "cpu", "world_size": 2}), str(tmp_path)) as ids:
        assert ids is None
    assert not (tmp_path / "devices.json").exists()


PROFILES = os.path.join(os.path.dirname(__file__), "..", "profiles")


def test_gpu_profiles_only_use_options_snakemake_knows():
    import yaml
    from snakemake.cli import get_argument_parser

    known = {a.lstrip("-") for action in get_argument_parser()._actions for a in action.option_strings}
    for name in ("local-gpus", "slurm"):
        with open(os.path.join(PROFILES, name, "config.yaml")) as fh:
            profile = yaml.safe_load(fh)
        assert set(profile) <= known, (name, set(profile) - known)
    with open(os.path.join(PROFILES, "slurm", "config.yaml")) as fh:
        slurm = yaml.safe_load(fh)
    assert slurm["executor"] == "slurm" and slurm["default-resources"]["gpu"] == 0


@pytest.mark.slow
def test_local_gpus_profile_dry_runs_the_workflow(tmp_path):
    from conftest import snakemake, tiny_config

    proc = snakemake(tmp_path, "--profile", os.path.join(PROFILES, "local-gpus"), "-n",
                     config=tiny_config({"ddp": {"experiments": [{"world_size": 2}]}}))
    assert "train" in proc.stdout and "collectives" in proc.stdout


def test_a_cuda_rank_gets_the_jobs_cores_split_over_its_ranks(monkeypatch):
    from distlab.launchers.environment import cuda_rank_threads, rank_environment

    spec = Spec({"device": "cuda", "world_size": 2, "cpu_threads_per_rank": 1})
    monkeypatch.setenv("DISTLAB_JOB_THREADS", "12")
    assert cuda_rank_threads(spec) == 6
    assert rank_environment(spec)["OMP_NUM_THREADS"] == "6"
    # On CPU a device stays cpu_threads_per_rank cores, whatever the job holds.
    assert rank_environment(spec.replace(device="cpu"))["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("DISTLAB_JOB_THREADS", "1")
    assert cuda_rank_threads(spec) == 1
