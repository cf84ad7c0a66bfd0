"""A rehearsal of the GPU box's software on CPU: the kit as the box would run it, minus the GPU.

A Python 3.12 venv holds what the box's image holds for the kit, at the box's versions (torch
2.11.0+cu130, the CUDA build the box has, which runs on CPU here; transformers 5.17.0,
accelerate 1.15.0, huggingface_hub 1.33.0, safetensors 0.8.0, tokenizers 0.23.2, numpy 2.5.2),
plus the other packages of the image that the kit needs at whatever versions resolve (their
box versions are not known). benchmarks/gpu_wheels.sh builds the carried wheels for Python
3.12 as for the box, and benchmarks/gpu_check.sh runs in DISTLAB_KIT_CPU_REHEARSAL mode:
wheels installed with --no-index into a target folder, the preflight, the kit's own config
with config/gpu_check_cpu_rehearsal.yaml over it (CPU ranks, tiny model, few steps), every
job to the report, and figures.txt. A dry run of pip resolves the carried set for Python 3.12
with --no-index. What it cannot show: anything of CUDA (no GPU here), Python 3.12.3 (3.12.1
here).

PyPI serves torch 2.11 for Linux only as its CUDA build: 2.6 GB to download with its nvidia-*
libraries, 5.2 GB in the venv (measured here, 2026-12-03, shared 2-core machine: wheel set 54 s
and venv 181 s cold; then 158-177 s for this module). The venv and the wheel set are kept under
DISTLAB_REHEARSAL_CACHE (default ~/.cache/distlab/box-rehearsal) and reused while their inputs
match. Skipped, with the reason, only when no package registry can be reached and nothing is
cached.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from distlab.records.run_outputs import read_run_record

CACHE = Path(os.environ.get("DISTLAB_REHEARSAL_CACHE", Path.home() / ".cache" / "distlab" / "box-rehearsal"))
BOX_PYTHON = "3.12"
# The box's versions (.library/device/KINDS.md, pip list seen 2026-11).
BOX_PINS = ["torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0", "huggingface_hub==1.33.0",
            "safetensors==0.8.0", "tokenizers==0.23.2", "numpy==2.5.2"]
# What distlab's jobs import that the box's image also holds (gpu_preflight.KIT_MODULES).
BOX_ALSO = ["peft", "pandas", "matplotlib", "pyyaml", "psutil", "nvidia-ml-py", "packaging"]
WHEELS_SCRIPT = REPO / "benchmarks" / "gpu_wheels.sh"
WHEEL_CACHE = CACHE / f"wheels-py{BOX_PYTHON}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def script_list(name: str) -> list[str]:
    """A bash array or string of gpu_wheels.sh (REQUIREMENTS, DEEPSPEED_DEPS, BOX_HAS, ...)."""
    text = WHEELS_SCRIPT.read_text()
    found = (re.search(rf'^{name}=\(([^)]*)\)', text, re.M) or re.search(rf'^{name}="([^"]*)"', text, re.M)
             or re.search(rf'^{name}=\$\{{{name}:-"([^"]*)"\}}', text, re.M))  # NAME=${NAME:-"default"}
    return [item.strip('"') for item in found.group(1).split()]


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def box_python() -> str:
    """An interpreter of the box's Python (3.12): DISTLAB_BOX_PYTHON, python3.12, pyenv's."""
    candidates = [os.environ.get("DISTLAB_BOX_PYTHON"), shutil.which("python3.12"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
                  "/usr/bin/python3.12"]
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys, venv, ensurepip; print(sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 12)":
            return candidate
    raise AssertionError("no Python 3.12 with venv and ensurepip here (the box's Python); set DISTLAB_BOX_PYTHON")


def registry_unreachable() -> str | None:
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(CACHE / "probe"), "platformdirs==4.14.9"], capture_output=True, text=True,
                           timeout=120)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["pip download failed"])[-1]


def build_box_venv(python: str, box_members: list[str]) -> Path:
    """The box image's packages for the kit, at the box's versions where known; kept in CACHE."""
    wanted = BOX_PINS + BOX_ALSO + sorted(set(box_members) - {normalize(p.split("==")[0]) for p in BOX_PINS})
    key = hashlib.sha256(json.dumps([python, wanted]).encode()).hexdigest()[:12]
    venv = CACHE / f"box-venv-py{BOX_PYTHON}-{key}"
    if (venv / ".complete").is_file():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    # The closure's own wheels first (same versions as the carried set was built with), the
    # registries for the rest (the torch 2.11 CUDA build and its nvidia-* libraries: PyPI).
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir",
                              "--find-links", str(WHEEL_CACHE), *wanted], capture_output=True, text=True, timeout=1800)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    (venv / ".complete").write_text("\n".join(wanted))
    return venv


@contextlib.contextmanager
def cache_lock():
    """One builder of the shared cache at a time (several checkouts' suites may run at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The carried wheels for 3.12, the box venv, then the kit's CPU rehearsal in it."""
    root = tmp_path_factory.mktemp("rehearsal")
    carried = root / "whl"
    box_has = {normalize(n) for n in script_list("BOX_HAS")}
    with cache_lock():
        if not (WHEEL_CACHE / ".inputs").is_file():
            reason = registry_unreachable()
            if reason:
                pytest.skip(f"package registry unreachable and nothing cached: {reason}")
        wheels = subprocess.run(["bash", str(WHEELS_SCRIPT)], capture_output=True, text=True, timeout=1800,
                                env=dict(os.environ, PYTHON=sys.executable, PYTHON_VERSION=BOX_PYTHON,
                                         DISTLAB_WHEEL_CACHE=str(WHEEL_CACHE), DISTLAB_WHEEL_DEST=str(carried)))
        assert wheels.returncode == 0, wheels.stdout[-3000:] + wheels.stderr[-3000:]
        closure = sorted(WHEEL_CACHE.glob("*.whl"))
        venv = build_box_venv(box_python(), [wheel_name(w) for w in closure if wheel_name(w) in box_has])
    out = root / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISTLAB_GPU_COUNT")}
    env.update(PYTHON=str(venv / "bin" / "python"), DISTLAB_KIT_CPU_REHEARSAL="1", KIT_WHEELS=str(carried),
               KIT_SITE=str(root / "site"), KIT_WORK=str(root / "work"), HOME=str(root))
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True,
                         text=True, timeout=900, env=env)
    return {"run": run, "out": out, "work": root / "work", "carried": carried, "closure": closure,
            "box_has": box_has}


def kit_output(kit) -> str:
    log = kit["out"] / "snakemake.log"
    return kit["run"].stdout[-4000:] + kit["run"].stderr[-4000:] + (log.read_text()[-4000:] if log.is_file() else "")


@pytest.mark.slow
def test_the_kit_runs_on_cpu_with_the_boxs_torch_2_11_and_library_versions_to_the_report_and_figures(kit):
    assert kit["run"].returncode == 0, kit_output(kit)
    versions = (kit["out"] / "versions.txt").read_text()
    assert "CPU rehearsal: no GPU was used" in versions
    assert re.search(r"python 3\.12\.\d+ torch 2\.11\.0\+cu130 cuda 13\.\d+ transformers 5\.17\.0 accelerate 1\.15\.0 "
                     r"huggingface_hub 1\.33\.0 safetensors 0\.8\.0 tokenizers 0\.23\.2", versions), versions
    assert "deepspeed 0.19.8" in versions
    # torch 2.11 predates the single-tensor collectives: the preflight names the fallbacks in use.
    assert "torch.distributed.all_gather_single absent; distlab falls back to " \
           "torch.distributed.all_gather_into_tensor" in kit["run"].stdout
    assert "CPU rehearsal: CUDA and GPU memory not checked (torch 2.11.0+cu130)" in kit["run"].stdout
    assert (kit["out"] / "report" / "index.html").is_file() and (kit["out"] / "summary.csv").is_file()
    figures = (kit["out"] / "figures.txt").read_text()
    assert figures.startswith("CPU rehearsal: no GPU was used") and "FAILED" not in figures, figures
    from distlab.tools.gpu_summary import planned

    plan = planned([str(REPO / "config" / "gpu_check.yaml"), str(REPO / "config" / "gpu_check_cpu_rehearsal.yaml")],
                   gpus=0)
    assert len(plan["experiments"]) == 4 and len(plan["validated"]) == 2
    for run in plan["experiments"]:  # the budget run may fit its 2 GiB on CPU: then it trains
        assert re.search(rf"^{run}: ([\d,]+ tokens/s|recorded OOM)", figures, re.M), figures
    for run in plan["validated"]:
        assert re.search(rf"^{run}: checkpoint validation passed", figures, re.M), figures


@pytest.mark.slow
def test_transformers_5_17_builds_zero3_bf16_with_a_bf16_inv_freq_and_distlab_puts_the_fp32_one_back(kit):
    """5.17 lacks prevent_arange_dtype_change: the kit's bf16 ZeRO-3 run is built with a rounded
    bf16 inv_freq, and distlab.runtime.buffers restores the plain model's before the wrap."""
    (metrics_path,) = kit["work"].glob("results/*/deepspeed-z3-*/metrics.json")
    buffers = read_run_record(metrics_path).to_dict()["as_built"]["buffers"]
    assert "model.rotary_emb.inv_freq" in buffers["restored_before_wrap"], buffers
    assert buffers["dtypes"]["model.rotary_emb.inv_freq"] == "float32"


@pytest.mark.slow
def test_the_carried_set_resolves_for_the_boxs_python_3_12_with_no_index(kit, tmp_path):
    platforms = [arg for tag in script_list("PLATFORMS") for arg in ("--platform", tag)]
    # pip 23 takes --python-version/--platform only with --target, even in a dry run (nothing is written).
    dry = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--no-index",
           "--only-binary=:all:", "--python-version", BOX_PYTHON, "--implementation", "cp", *platforms,
           "--target", str(tmp_path / "not-written"), "--find-links", str(WHEEL_CACHE)]
    report = tmp_path / "report.json"
    resolved = subprocess.run(dry + ["--report", str(report), *script_list("REQUIREMENTS"),
                                     *script_list("DEEPSPEED_DEPS")], capture_output=True, text=True, timeout=600)
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    deepspeed = subprocess.run(dry + ["--no-deps", script_list("DEEPSPEED")[0]], capture_output=True, text=True,
                               timeout=300)
    assert deepspeed.returncode == 0, deepspeed.stderr[-3000:]
    names = {normalize(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
    carried = {wheel_name(w) for w in kit["carried"].glob("*.whl")}
    assert carried - {"deepspeed"} <= names, carried - names  # every carried wheel is part of the resolution
    assert names - carried <= kit["box_has"], names - carried - kit["box_has"]  # the rest is on the box
