"""The GPU check kit: refuses plainly without a GPU; its config is valid and plans a run."""
import os
import re
import subprocess

import pytest

import yaml

from conftest import REPO, snakemake
from distlab.configuration.config import ConfigError, load

GPU_CONFIG = REPO / "config" / "gpu_check.yaml"


@pytest.mark.slow
def test_kit_says_in_one_line_that_there_is_no_gpu_and_fails(tmp_path):
    # No carried wheels (a checkout may hold a .whl/ built for the GPU box's Python): the answer
    # must come from the GPU check, not from pip refusing another Python's wheels.
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", KIT_WHEELS=str(tmp_path / "no-wheels")))
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2
    assert len(out) == 1 and "no CUDA GPU" in out[0]


def test_gpu_config_is_schema_valid_and_covers_the_cuda_paths():
    _, specs = load(yaml.safe_load(GPU_CONFIG.read_text()), gpu_count=1)
    by_strategy = {(s["strategy"], s["memory_budget_gib"] is not None): s for s in specs.values()}
    assert all(s["device"] == "cuda" and s["world_size"] == 1 for s in specs.values())
    assert by_strategy[("ddp", False)]["precision"] == "bf16"
    assert by_strategy[("ddp", True)]["memory_budget_gib"] == 2
    ds = by_strategy[("deepspeed", False)]["deepspeed"]
    assert ds["zero_stage"] == 3 and ds["offload_optimizer"] == ds["offload_param"] == "cpu"
    assert by_strategy[("fsdp", False)]["precision"] == "bf16"


def test_gpu_config_is_refused_where_there_is_no_gpu():
    try:
        load(yaml.safe_load(GPU_CONFIG.read_text()), gpu_count=0)
    except ConfigError as err:
        assert "device" in str(err) and "GPUs" in str(err)
    else:
        raise AssertionError("a cuda config must not plan on a machine without GPUs")


def planned_jobs(stdout: str) -> list[dict]:
    """(rule, threads, gpu, runtime in minutes) of every job a dry run prints."""
    jobs = []
    for block in re.split(r"\n(?=rule |localrule )", stdout):
        head = re.match(r"(?:local)?rule (\w+):", block)
        if not head:
            continue
        threads = re.search(r"^\s+threads: (\d+)", block, re.M)
        gpu = re.search(r"^\s+resources: .*\bgpu=(\d+)", block, re.M)
        runtime = re.search(r"^\s+resources: .*\bruntime=(\d+)", block, re.M)
        jobs.append({"rule": head.group(1), "threads": int(threads.group(1)) if threads else 1,
                     "gpu": int(gpu.group(1)) if gpu else 0, "runtime": int(runtime.group(1)) if runtime else None})
    return jobs


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_kit_plan_needs_no_more_gpus_than_exist_and_reaches_the_report(tmp_path, monkeypatch, gpus):
    monkeypatch.setenv("DISTLAB_GPU_COUNT", str(gpus))
    # No --resources: what each job declares is printed unclamped.
    proc = snakemake(tmp_path, "-n", "--cores", "16", "--configfile", str(GPU_CONFIG))
    jobs = planned_jobs(proc.stdout)
    rules = {job["rule"] for job in jobs}
    assert {"train", "validate_checkpoint", "collectives", "report"} <= rules
    assert max(job["gpu"] for job in jobs) <= gpus
    (bench,) = [job for job in jobs if job["rule"] == "collectives"]
    assert bench["gpu"] == (0 if gpus == 1 else 2)  # 1 GPU: gloo on CPU ranks, NCCL recorded as skipped
    # CUDA ranks get host cores: 1 rank x cuda_cpu_threads_per_rank (12 in the kit's config).
    assert {job["threads"] for job in jobs if job["rule"] == "train"} == {12}
    expected_validation = 12 * min(2, gpus)  # 1 GPU: the reshard to 2 ranks is not run
    assert {min(job["threads"], 16) for job in jobs if job["rule"] == "validate_checkpoint"} == \
        {min(expected_validation, 16)}


# The box stops any command after 10 minutes; besides Snakemake the kit installs its wheels,
# runs the preflight and prints the summary (a minute at most is left for them).
BOX_COMMAND_LIMIT_S = 600
OUTSIDE_SNAKEMAKE_S = 60
PROBE_S = 30


def kit_timeout_s() -> int:
    return int(re.search(r"^SNAKEMAKE_CAP_S=(\d+)$", (REPO / "benchmarks" / "gpu_check.sh").read_text(), re.M).group(1))


@pytest.fixture(scope="module")
def one_gpu_plan(tmp_path_factory):
    from unittest import mock

    with mock.patch.dict(os.environ, {"DISTLAB_GPU_COUNT": "1"}):
        proc = snakemake(tmp_path_factory.mktemp("plan1"), "-n", "--cores", "16", "--configfile", str(GPU_CONFIG))
    return planned_jobs(proc.stdout)


def test_the_kits_serial_gpu_jobs_plan_at_most_75_percent_of_its_timeout_inside_the_boxs_limit(one_gpu_plan):
    gpu_jobs = [job for job in one_gpu_plan if job["gpu"]]
    assert {job["rule"] for job in gpu_jobs} == {"compute_probe", "train", "validate_checkpoint"}
    # One GPU: they run one after the other. A compute probe's runtime resource is Snakemake's
    # smallest (1 minute); its work is its imports and at most ~40 kernels of <= 0.05 s after a
    # warm-up call each (distlab.tools.compute_probe): PROBE_S, not measured on a GPU yet.
    planned_s = sum(PROBE_S if job["rule"] == "compute_probe" else 60 * job["runtime"] for job in gpu_jobs)
    # 70% before the step-time prediction's probe joined the plan (its ~30 s take the rest).
    assert planned_s <= 0.75 * kit_timeout_s(), (planned_s, kit_timeout_s(), gpu_jobs)
    assert kit_timeout_s() + OUTSIDE_SNAKEMAKE_S <= BOX_COMMAND_LIMIT_S


def test_the_base_model_eval_on_the_critical_path_gets_a_ranks_cores(one_gpu_plan, prepared, tmp_path):
    (evaluation,) = [job for job in one_gpu_plan if job["rule"] == "evaluate_base_model"]
    assert evaluation["threads"] == 12  # cuda_cpu_threads_per_rank in the kit's config
    import torch

    from distlab.runtime.evaluation import evaluate_base

    before = torch.get_num_threads()
    try:
        result = evaluate_base(str(prepared / "model"), prepared / "data32", tmp_path / "base.json", threads=2)
    finally:
        torch.set_num_threads(before)  # the worker's other tests keep their own setting
    assert result["threads"] == 2
