"""What this machine has: GPUs through pynvml (or none), the CPU, and a measured peak.

gpu_count() and machine_tag() run at Snakefile parse time, so they avoid torch.
"""
from __future__ import annotations

import os
import platform
import re
import socket

# Dense bf16 peaks in FLOP/s (torchtitan's table, vendor datasheets). MFU on a GPU not
# listed here is left empty rather than guessed.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


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


def gpu_peak_flops(name: str) -> float | None:
    for key, peak in GPU_PEAK_BF16.items():
        if key.lower() in name.lower():
            return peak
    return None


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
                    "peak_bf16_flops": gpu_peak_flops(name)}
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
    info = {"schema_version": 1, "machine": machine_tag(configured_tag), "hostname": socket.gethostname(),
            "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_info(),
            "gpus": found, "gpu_count": len(found)}
    if probe:
        info["cpu_peak"] = {
            "per_thread": measure_cpu_matmul_peak(1),
            "all_threads": measure_cpu_matmul_peak(info["cpu"]["usable_cores"]),
            "how": "median time of a 1024x1024 fp32 torch matmul after warm-up (2*n^3 FLOPs)",
        }
    return info
