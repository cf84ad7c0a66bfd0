"""The GPU check kit: refuses plainly without a GPU; its config is valid and plans a run."""
import os
import subprocess

import yaml

from conftest import REPO, snakemake
from distlab.config import ConfigError, load

GPU_CONFIG = REPO / "config" / "gpu_check.yaml"


def test_kit_says_in_one_line_that_there_is_no_gpu_and_fails():
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "/tmp/unused-gpu-check-out"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
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


def test_gpu_config_dry_runs_when_planned_for_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_GPU_COUNT", "1")
    proc = snakemake(tmp_path, "-n", "--configfile", str(GPU_CONFIG))
    assert "train" in proc.stdout and "experiment=ddp-full-w1-mb8-ga1-budget2g" in proc.stdout
