"""The GPU kit's wheel set (benchmarks/gpu_wheels.sh) installs from .whl files alone, with
`pip install --no-index --find-links`, into a clean venv, and imports there.

The box runs Python 3.12; this test builds the same set for the interpreter running it (the
script is parametrised by version and platform), so the same resolution is checked here.
The whole closure is built once into a cache (build/wheel-cache/, or DISTLAB_WHEEL_CACHE)
and reused by later runs. Torch is not in the set (the box has its own CUDA torch), so the
clean venv has no torch: deepspeed's wheel is installed and its other requirements checked,
but not imported. Skipped, with the reason, only when no package registry can be reached.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
CACHE = Path(os.environ.get("DISTLAB_WHEEL_CACHE", REPO / "build" / "wheel-cache")) / f"py{HERE}"
KIT = ["snakemake==9.27.1", "datasets==5.2.0", "jsonschema==4.26.0", "platformdirs==4.14.9", "hjson", "pydantic",
       "py-cpuinfo", "msgpack", "ninja", "einops", "nvidia-ml-py"]


def build_wheels(dest: Path, keep_box: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHON_VERSION=HERE, DISTLAB_WHEEL_DEST=str(dest),
               DISTLAB_WHEEL_CACHE=str(CACHE), KEEP_BOX="1" if keep_box else "0")
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh")], env=env, capture_output=True,
                          text=True, timeout=900)


def registry_unreachable() -> str | None:
    """Why no registry answers (None when one does): a one-wheel download is the probe."""
    if (CACHE / ".inputs").is_file():
        return None  # a complete cache needs no registry
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(CACHE.parent / "probe"), "platformdirs==4.14.9"],
                           capture_output=True, text=True, timeout=120)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["pip download failed"])[-1]


@pytest.fixture(scope="module")
def kit_wheels(tmp_path_factory):
    reason = registry_unreachable()
    if reason:
        pytest.skip(f"package registry unreachable, the wheel set cannot be built: {reason}")
    dest = tmp_path_factory.mktemp("wheels") / "all"
    proc = build_wheels(dest, keep_box=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dest


@pytest.mark.slow
def test_kit_wheel_set_installs_with_no_index_into_a_clean_venv_and_imports(kit_wheels, tmp_path):
    assert all(p.suffix == ".whl" for p in kit_wheels.iterdir() if p.name != ".distlab-wheels")
    assert not list(kit_wheels.glob("torch-*.whl")), "the set must not carry a torch"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile", "--no-index",
           "--only-binary=:all:",
           "--find-links", str(kit_wheels)]
    install = subprocess.run(pip + KIT, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    deepspeed = subprocess.run(pip + ["--no-deps", "deepspeed==0.19.8"], capture_output=True, text=True, timeout=300)
    assert deepspeed.returncode == 0, deepspeed.stderr[-3000:]
    check = (
        "import snakemake.api, snakemake.cli, datasets, jsonschema, platformdirs, hjson, pydantic, yaml\n"
        "from distlab.tools.gpu_preflight import missing_requirements\n"
        "print('\\n'.join(missing_requirements(['snakemake', 'datasets', 'jsonschema', 'deepspeed'])))\n")
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only torch, the box's own, is missing for deepspeed; everything else came from the wheels.
    assert proc.stdout.split("\n")[0].startswith("deepspeed needs torch") and proc.stdout.strip().count("\n") == 0


@pytest.mark.slow
def test_box_set_keeps_what_the_box_lacks_and_drops_what_it_has(kit_wheels, tmp_path):
    proc = build_wheels(tmp_path / "box", keep_box=False)  # reuses the cache: no registry
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {p.name.split("-")[0].lower() for p in (tmp_path / "box").glob("*.whl")}
    assert {"platformdirs", "snakemake", "datasets", "jsonschema", "deepspeed", "connection_pool", "pulp"} <= names
    assert not names & {"numpy", "torch", "pyyaml", "pandas", "pyarrow", "packaging"}


@pytest.mark.parametrize("folder", ["DISTLAB_WHEEL_CACHE", "DISTLAB_WHEEL_DEST"])
def test_the_script_refuses_a_folder_it_did_not_make_and_reads_no_generic_names(tmp_path, folder):
    """CACHE and DEST, generic names CI systems export, once named folders this script emptied."""
    mine, generic = tmp_path / "my-files", tmp_path / "generic"
    for path in (mine, generic):
        path.mkdir()
        (path / "keep.txt").write_text("mine")
    env = dict(os.environ, PYTHON=sys.executable, CACHE=str(generic), DEST=str(generic),
               DISTLAB_WHEEL_CACHE=str(tmp_path / "new-cache"), DISTLAB_WHEEL_DEST=str(tmp_path / "new-dest"))
    env[folder] = str(mine)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and f"refusing {folder}={mine}" in proc.stderr, proc.stderr
    assert (mine / "keep.txt").read_text() == "mine" and (generic / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "new-cache").exists()  # refused before anything ran
