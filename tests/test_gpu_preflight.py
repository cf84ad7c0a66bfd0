"""The GPU kit's preflight names exactly what is missing: torch, an old torch, a module, a
module's own requirement, CUDA, free memory. Modules are simulated missing by monkeypatching."""
from __future__ import annotations

import types

import pytest

from distlab.tools import gpu_preflight as pf

GIB = 2**30


def fake_torch(version="2.11.0+cu130", gpus=1, free_gib=130.0):
    cuda = types.SimpleNamespace(
        is_available=lambda: gpus > 0, device_count=lambda: gpus,
        mem_get_info=lambda i: (int(free_gib * GIB), int(139 * GIB)),
        get_device_name=lambda i: "NVIDIA H200", OutOfMemoryError=MemoryError)
    return types.SimpleNamespace(__version__=version, cuda=cuda, version=types.SimpleNamespace(cuda="13.0"))


@pytest.fixture
def machine(monkeypatch):
    """A machine whose importable modules are `machine.modules` (name -> module or None)."""
    state = types.SimpleNamespace(modules={name: types.ModuleType(name) for name in pf.KIT_MODULES})
    state.modules["torch"] = fake_torch()

    def fake_import(name):
        module = state.modules.get(name)
        if module is None:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return module

    monkeypatch.setattr(pf, "_quiet_import", fake_import)
    monkeypatch.setattr(pf, "missing_requirements", lambda dists, conflicts=None: [])
    monkeypatch.setattr(pf, "check_torch_apis", lambda report: None)
    return state


def test_missing_torch_is_reported_as_missing_torch_not_as_no_gpu(machine):
    machine.modules["torch"] = None
    report = pf.preflight()
    assert report.status == 3
    assert any("torch is not installed" in line for line in report.lines())
    assert not any("no CUDA GPU" in line for line in report.lines())


def test_torch_older_than_pyprojects_lowest_is_refused_with_both_versions(machine):
    lowest = pf.lowest_supported_torch()
    assert lowest == "2.6"  # pyproject.toml: torch>=2.6
    machine.modules["torch"] = fake_torch(version="2.5.1+cu124")
    (line,) = pf.preflight().lines()
    assert "torch 2.5.1+cu124 is older than the lowest supported 2.6" in line


def test_the_boxs_torch_2_11_passes_the_version_check(machine):
    report = pf.preflight()
    assert report.status == 0 and report.lines() == []
    assert any("NVIDIA H200" in note and "130.0 of 139.0 GiB free" in note for note in report.notes)


def test_each_missing_module_is_named_with_its_distribution(machine):
    machine.modules["yaml"] = None
    machine.modules["deepspeed"] = None
    lines = pf.preflight().lines()
    assert any("yaml (pyyaml) not installed" in line and "gpu_wheels.sh" in line for line in lines)
    assert any("deepspeed (deepspeed) not installed" in line for line in lines)


def test_a_missing_transitive_requirement_is_named_with_who_needs_it(machine, monkeypatch):
    monkeypatch.setattr(pf, "missing_requirements", lambda dists,
                        conflicts=None: ["snakemake needs platformdirs (not installed)"])
    report = pf.preflight()
    assert report.status == 3
    assert report.lines() == ["gpu_check preflight: MISSING: snakemake needs platformdirs (not installed)"]


def test_requirement_closure_finds_an_uninstalled_dependency(monkeypatch):
    from importlib import metadata

    requires = {"kit": ["dep-a>=2", "optional-b; extra == 'x'"], "dep-a": ["platformdirs"]}
    installed = {"kit", "dep-a"}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return "1.0"

    monkeypatch.setattr(metadata, "requires", lambda name: requires.get(name) if name in installed else
                        (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))
    monkeypatch.setattr(metadata, "version", version)
    conflicts = []
    assert pf.missing_requirements(["kit"], conflicts) == ["dep-a needs platformdirs (not installed)"]
    assert conflicts == ["kit asks for dep-a>=2, dep-a 1.0 is installed"]


def test_no_cuda_gpu_is_its_own_status_and_one_line(machine):
    machine.modules["torch"] = fake_torch(gpus=0)
    report = pf.preflight()
    assert report.status == 2
    (line,) = report.lines()
    assert "no CUDA GPU visible to torch 2.11.0+cu130" in line


def test_too_little_free_gpu_memory_is_reported(machine):
    machine.modules["torch"] = fake_torch(free_gib=3.0)
    (line,) = pf.preflight(min_free_gib=8).lines()
    assert "cuda:0 (NVIDIA H200) has 3.0 GiB free; the kit needs 8 GiB" in line


def test_a_torch_api_with_a_fallback_passes_and_one_without_fails(monkeypatch):
    import torch.distributed as dist

    report = pf.Report()
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    pf.check_torch_apis(report, [("torch.distributed", "all_gather_single",
                                  ("torch.distributed.all_gather_into_tensor",)),
                                 ("torch.distributed", "no_such_collective", ())])
    assert report.notes == ["torch.distributed.all_gather_single absent; distlab falls back to "
                            "torch.distributed.all_gather_into_tensor"]
    assert report.problems == ["torch API torch.distributed.no_such_collective is missing (and no fallback: none)"]


def test_a_cpu_rehearsal_checks_everything_but_cuda_and_says_so(machine):
    machine.modules["torch"] = fake_torch(gpus=0)
    report = pf.preflight(cuda=False)
    assert report.status == 0 and report.lines() == []
    assert any("CPU rehearsal: CUDA and GPU memory not checked" in note for note in report.notes)
    machine.modules["datasets"] = None
    assert pf.preflight(cuda=False).status == 3  # a missing module still stops the rehearsal
