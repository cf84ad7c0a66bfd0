"""What this machine has: GPUs through pynvml (or none), the CPU, and a measured peak;
per rank: the NVML handle of the rank's own board and its MFU denominator.

gpu_count() and machine_tag() run at Snakefile parse time, so they avoid torch.
"""
from __future__ import annotations

import os
import platform
import re
import socket
import statistics

from distlab.records.spec import SpecFields

# Peak dense FLOP/s per board variant and matmul precision, from NVIDIA's datasheets
# (datasheets give sparse tensor figures for Ampere and later: dense = half of those).
# Keys are the exact names torch / NVML report; a name not listed gets a measured matmul
# probe, never a guess by substring ("H100" alone matches nothing: PCIe, NVL and SXM differ).
# tf32: fp32 matmuls on tensor cores (allow_tf32 / float32_matmul_precision != "highest").
# None: the board has no such tensor path (V100: no bf16, no tf32).
_T = 1e12
GPU_PEAKS = [
    # (names, fp32, tf32, bf16, fp16, source)
    (("NVIDIA H100 80GB HBM3",), 67 * _T, 494.5 * _T, 989.5 * _T, 989.5 * _T, "H100 SXM5 datasheet"),
    (("NVIDIA H100 PCIe",), 51 * _T, 378 * _T, 756.5 * _T, 756.5 * _T, "H100 PCIe datasheet"),
    (("NVIDIA H100 NVL",), 60 * _T, 417.5 * _T, 835.5 * _T, 835.5 * _T, "H100 NVL datasheet"),
    (("NVIDIA H200",), 67 * _T, 494.5 * _T, 989.5 * _T, 989.5 * _T, "H200 SXM datasheet"),
    (("NVIDIA H200 NVL",), 60 * _T, 417.5 * _T, 835.5 * _T, 835.5 * _T, "H200 NVL datasheet"),
    (("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"),
     19.5 * _T, 156 * _T, 312 * _T, 312 * _T, "A100 datasheet (40/80 GB, SXM and PCIe)"),
    (("NVIDIA L40S",), 91.6 * _T, 183 * _T, 362.05 * _T, 362.05 * _T, "L40S datasheet"),
    (("NVIDIA L40",), 90.5 * _T, 90.5 * _T, 181.05 * _T, 181.05 * _T, "L40 datasheet"),
    (("NVIDIA L4",), 30.3 * _T, 60 * _T, 121 * _T, 121 * _T, "L4 datasheet"),
    (("NVIDIA A10",), 31.2 * _T, 62.5 * _T, 125 * _T, 125 * _T, "A10 datasheet"),
    (("NVIDIA A40",), 37.4 * _T, 74.8 * _T, 149.7 * _T, 149.7 * _T, "A40 datasheet"),
    (("NVIDIA GeForce RTX 4090",), 82.6 * _T, 82.6 * _T, 165.2 * _T, 165.2 * _T,
     "Ada (AD102) whitepaper, FP32 accumulate"),
    (("NVIDIA GeForce RTX 3090",), 35.6 * _T, 35.6 * _T, 71 * _T, 71 * _T, "Ampere GA102 whitepaper, FP32 accumulate"),
    (("NVIDIA GeForce RTX 3060",), 12.7 * _T, 12.7 * _T, 25.5 * _T, 25.5 * _T,
     "RTX 3060 specifications (3584 CUDA cores, 112 tensor cores, 1.78 GHz boost) at the Ampere GA10x "
     "whitepaper's per-SM rates, FP32 accumulate"),
    (("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"), 15.7 * _T, None, None, 125 * _T, "V100 datasheet (SXM2)"),
    (("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"), 14 * _T, None, None, 112 * _T, "V100 datasheet (PCIe)"),
    (("Tesla V100S-PCIE-32GB",), 16.4 * _T, None, None, 130 * _T, "V100S datasheet"),
]
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def _board_key(name: str) -> str:
    return " ".join(name.split()).casefold()


_BY_NAME = {_board_key(n): (dict(zip(PRECISIONS, row[1:5])), row[5]) for row in GPU_PEAKS for n in row[0]}


def gpu_peak(name: str, precision: str) -> tuple[float | None, str | None]:
    """(dense peak FLOP/s, source) of board `name` (exact name) at precision fp32/tf32/bf16/fp16."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown matmul precision {precision!r}; one of {PRECISIONS}")
    found = _BY_NAME.get(_board_key(name))
    if found is None:
        return None, None
    return found[0][precision], found[1]


def matmul_precision(run_precision: str, tf32: bool) -> str:
    """The tensor path a run's matmuls take: bf16/fp16 autocast, else fp32 or TF32."""
    from distlab.configuration.precision import is_mixed

    if is_mixed(run_precision):
        return run_precision
    return "tf32" if tf32 else "fp32"


def tf32_matmuls(torch) -> bool:
    """Whether fp32 matmuls run as TF32 in this process (either of torch's switches)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _nvml():
    """pynvml, initialised; None when there is no NVIDIA driver (the normal CPU case).

    Any other NVML failure is raised: treating a broken driver as "no GPU" would silently
    turn device 'auto' into a CPU run on a GPU machine.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return None
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML is installed but failed to start ({exc}); fix the NVIDIA driver, or set "
                           "device: cpu explicitly") from exc
    return pynvml


def gpu_count() -> int:
    """GPUs on this machine (pynvml). DISTLAB_GPU_COUNT overrides it for planning only
    (dry-running a GPU config on a laptop); the ranks still check torch.cuda at run time."""
    planned = os.environ.get("DISTLAB_GPU_COUNT")
    if planned is not None:
        return int(planned)
    nvml = _nvml()
    if nvml is None:
        return 0
    try:
        return nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()


def nvml_handle(device, nvml=None):
    """NVML handle of the physical GPU behind torch `device`, found by its UUID, else by its
    PCI bus id. Never by ordinal: with CUDA_VISIBLE_DEVICES=3,5 torch's cuda:0 is NVML's 3.
    nvml: the initialised pynvml module (default: import it)."""
    import torch

    if nvml is None:
        import pynvml as nvml
    props = torch.cuda.get_device_properties(device)
    tried = []
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        key = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        try:
            return nvml.nvmlDeviceGetHandleByUUID(key)
        except nvml.NVMLError as exc:
            tried.append(f"UUID {key}: {exc}")
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(pci)
        except nvml.NVMLError as exc:
            tried.append(f"PCI bus id {pci}: {exc}")
    raise RuntimeError(f"no NVML device matches torch {device} "
                       f"({'; '.join(tried) or 'torch reports neither a UUID nor a PCI bus id'})")


def measure_cuda_matmul_peak(device, precision: str, size: int = 4096, repeats: int = 10) -> dict:
    """Achieved FLOP/s of a size^3 matmul at `precision` on `device`: median of `repeats`
    products timed with CUDA events after warm-up, on random data (zeros run faster)."""
    import torch

    from distlab.configuration.precision import torch_dtype

    dtype = torch_dtype(precision)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    median = statistics.median(times)
    return {"precision": precision, "matrix": size, "repeats": repeats, "median_s": median,
            "flops_per_s": 2 * size**3 / median}


def peak_flops_per_rank(device, spec: SpecFields, hardware: dict) -> tuple[float | None, str]:
    """MFU denominator of one rank and how it was found. CUDA: the datasheet peak of this
    rank's board at the precision its matmuls run in (bf16/fp16 autocast; fp32 as TF32 or
    not, as torch is set), or a measured matmul probe where the board is not in the table.
    CPU: the hardware rule's measured one-thread matmul peak x the rank's threads."""
    if device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
        precision = matmul_precision(spec.precision, tf32_matmuls(torch))
        peak, source = gpu_peak(name, precision)
        if peak:
            return peak, f"dense {precision} peak of {name} ({source})"
        probe = measure_cuda_matmul_peak(device, precision)
        why = "not in the datasheet table" if source is None else f"has no {precision} tensor path ({source})"
        return probe["flops_per_s"], (f"measured: {name} {why}; median of {probe['repeats']} "
                                      f"{probe['matrix']}^3 {precision} matmuls timed with CUDA events")
    probe = hardware.get("cpu_peak", {}).get("per_thread")
    if not probe:
        return None, "no CPU probe in hardware.json"
    threads = spec.cpu_threads_per_rank
    return probe["flops_per_s"] * threads, (f"measured fp32 matmul peak of one thread x {threads} "
                                            "thread(s) per rank (hardware rule)")


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "machine"


def gpus() -> list[dict]:
    nvml = _nvml()
    if nvml is None:
        return []
    out = []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            info = {"index": index, "name": name, "memory_total_bytes": int(memory.total),
                    "peak_bf16_flops": gpu_peak(name, "bf16")[0],
                    "peak_flops": {p: gpu_peak(name, p)[0] for p in PRECISIONS}}
            for key, call in (("pcie_generation", nvml.nvmlDeviceGetCurrPcieLinkGeneration),
                              ("pcie_width", nvml.nvmlDeviceGetCurrPcieLinkWidth)):
                try:
                    info[key] = int(call(handle))
                except Exception as exc:  # not every board reports every field
                    info[key] = None
                    info[f"{key}_error"] = str(exc)
            active = 0
            for link in range(18):  # NVML_NVLINK_MAX_LINKS
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link):
                        active += 1
                except Exception:
                    break
            info["nvlink_active_links"] = active
            out.append(info)
    finally:
        nvml.nvmlShutdown()
    return out


def cpu_info() -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def machine_tag(configured: str | None = None) -> str:
    """results/<tag>/: the configured tag, else host name plus the accelerator summary."""
    if configured:
        return configured
    host = _sanitize(socket.gethostname().split(".")[0])
    found = gpus()
    if found:
        short = _sanitize(found[0]["name"].replace("NVIDIA", "").strip())
        return f"{host}-{len(found)}x{short}"
    return f"{host}-cpu{cpu_info()['usable_cores']}"


def measure_cpu_matmul_peak(threads: int, size: int = 1024, seconds: float = 1.5) -> dict:
    """Achievable fp32 matmul FLOP/s on `threads` cores: the MFU denominator on CPU.

    A large square matmul is the best case a CPU reaches; measured once per machine by the
    hardware rule, median of repeated timings after a warm-up.
    """
    import statistics
    import time

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        for _ in range(3):
            a @ b
        samples = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(samples) < 5:
            start = time.perf_counter()
            a @ b
            samples.append(time.perf_counter() - start)
        flops = 2 * size**3
        median = statistics.median(samples)
        return {"threads": threads, "matrix": size, "dtype": "float32", "repeats": len(samples),
                "median_s": median, "flops_per_s": flops / median,
                "spread_flops_per_s": [flops / max(samples), flops / min(samples)]}
    finally:
        torch.set_num_threads(previous)


def describe(configured_tag: str | None, probe: bool = True) -> dict:
    found = gpus()
    info = {"schema_version": 1, "machine": machine_tag(configured_tag),
            "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_info(),
            "gpus": found, "gpu_count": len(found)}
    if not configured_tag:  # the tag is derived from the host name anyway; a set `machine:` keeps it out
        info["hostname"] = socket.gethostname()
    if probe:
        info["cpu_peak"] = {
            "per_thread": measure_cpu_matmul_peak(1),
            "all_threads": measure_cpu_matmul_peak(info["cpu"]["usable_cores"]),
            "how": "median time of a 1024x1024 fp32 torch matmul after warm-up (2*n^3 FLOPs)",
        }
    return info
