"""GPU facts per rank: the datasheet peak by exact board name and the run's matmul
precision (a measured probe where the board is unknown), and NVML handles found by UUID or
PCI bus id, so a remapped CUDA_VISIBLE_DEVICES reads the right board."""
from __future__ import annotations

import types

import pytest
from distlab.records.spec import Spec
import torch

from distlab.configuration import hardware as hw


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bf16", 989.5e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),  # not the SXM peak
    ("NVIDIA H100 NVL", "bf16", 835.5e12),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.5e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA L40S", "fp16", 362.05e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6e12),
    ("Tesla V100-SXM2-32GB", "fp16", 125e12),
])
def test_peak_is_the_datasheet_figure_of_that_exact_board_and_precision(name, precision, peak):
    found, source = hw.gpu_peak(name, precision)
    assert found == pytest.approx(peak) and source


def test_a_name_that_only_contains_a_known_board_gets_no_peak():
    assert hw.gpu_peak("H100", "bf16") == (None, None)
    assert hw.gpu_peak("NVIDIA H100 80GB HBM3 (some new variant)", "bf16") == (None, None)
    assert hw.gpu_peak("Tesla V100-SXM2-16GB", "bf16")[0] is None  # no bf16 tensor cores
    with pytest.raises(ValueError, match="precision"):
        hw.gpu_peak("NVIDIA H200", "int8")


def test_fp32_runs_use_the_tf32_peak_only_when_torch_runs_fp32_matmuls_as_tf32():
    assert hw.matmul_precision("bf16", tf32=True) == "bf16"
    assert hw.matmul_precision("fp32", tf32=False) == "fp32"
    assert hw.matmul_precision("fp32", tf32=True) == "tf32"
    # Set and restored by hand: allow_tf32 is a property of torch's cuBLAS module object, which
    # pytest's monkeypatch (9.2) cannot restore (it tries to delete it).
    previous, previous_tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        assert hw.tf32_matmuls(torch) is False
        torch.set_float32_matmul_precision("high")
        assert hw.tf32_matmuls(torch) is True
    finally:
        torch.set_float32_matmul_precision(previous)
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32


def test_rank_peak_follows_the_runs_precision_and_probes_an_unknown_board(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    monkeypatch.setattr(hw, "tf32_matmuls", lambda torch: False)
    cuda0 = types.SimpleNamespace(type="cuda", index=0)
    peak, how = hw.peak_flops_per_rank(cuda0, Spec({"precision": "fp32"}), {})
    assert peak == 51e12 and "dense fp32 peak of NVIDIA H100 PCIe" in how
    peak, how = hw.peak_flops_per_rank(cuda0, Spec({"precision": "bf16"}), {})
    assert peak == 756.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA Future GPU")
    monkeypatch.setattr(hw, "measure_cuda_matmul_peak", lambda device, precision: {
        "flops_per_s": 123e12, "repeats": 10, "matrix": 4096})
    peak, how = hw.peak_flops_per_rank(cuda0, Spec({"precision": "bf16"}), {})
    assert peak == 123e12 and how.startswith("measured: NVIDIA Future GPU not in the datasheet table")


class FakeNVML:
    """Eight physical GPUs; handles are their NVML indices."""

    class NVMLError(Exception):
        pass

    uuids = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]
    buses = [f"00000000:{0x10 + i:02X}:00.0" for i in range(8)]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.uuids:
            raise self.NVMLError("Not Found")
        return self.uuids.index(uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        if bus not in self.buses:
            raise self.NVMLError("Not Found")
        return self.buses.index(bus)


def remapped_properties(visible: list[int], with_uuid: bool = True):
    """torch.cuda.get_device_properties as torch answers it under CUDA_VISIBLE_DEVICES=visible."""
    def properties(device):
        physical = visible[torch.device(device).index]
        props = types.SimpleNamespace(pci_bus_id=0x10 + physical, pci_device_id=0, pci_domain_id=0)
        if with_uuid:
            props.uuid = FakeNVML.uuids[physical].removeprefix("GPU-")  # torch prints it bare
        return props
    return properties


@pytest.mark.parametrize("with_uuid", [True, False], ids=["by-uuid", "by-pci-bus-id"])
def test_nvml_handle_of_cuda0_is_the_physical_gpu_under_a_remapped_visible_list(monkeypatch, with_uuid):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setattr(torch.cuda, "get_device_properties", remapped_properties([3, 5], with_uuid))
    assert hw.nvml_handle(torch.device("cuda", 0), FakeNVML()) == 3
    assert hw.nvml_handle(torch.device("cuda", 1), FakeNVML()) == 5


def test_nvml_handle_fails_loudly_rather_than_falling_back_to_the_ordinal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        uuid="ffffffff-0000-0000-0000-000000000000", pci_bus_id=0x99, pci_device_id=0, pci_domain_id=0))
    with pytest.raises(RuntimeError, match="no NVML device matches"):
        hw.nvml_handle(torch.device("cuda", 0), FakeNVML())
