"""One rank's memory: the per-rank budget (enforced on CUDA and on CPU), the load-phase and
training-phase peaks, and the record a rank leaves when it runs out of memory.

The budget (`memory_budget_gib`) counts the whole rank process, as a machine's RAM would:
interpreter, torch/transformers/deepspeed and their libraries included.

- CUDA: `torch.cuda.set_per_process_memory_fraction(budget / device total)`; the caching
  allocator refuses past it (torch.OutOfMemoryError).
- CPU: `resource.setrlimit(RLIMIT_DATA, budget)`, set inside the rank process right after
  it starts (torch already imported). Since Linux 4.7 RLIMIT_DATA caps the process's
  private writable mappings (heap, anonymous mmap: every tensor storage, malloc arena and
  thread stack), so a tensor past it fails in the allocator ("DefaultCPUAllocator: can't
  allocate memory", a RuntimeError) and a Python object with MemoryError; both end the
  rank with status `oom` (record_oom + OOM_EXIT_CODE; distlab.launch writes the
  metrics.json). Checked on this machine: the import-only process has VmData within ~10%
  of VmRSS (473 vs 427 MB after torch+transformers+deepspeed+peft imports), and a
  tensor past the limit raises instead of being killed.
  Why not the alternatives: RLIMIT_AS counts address space that is reserved, not used
  (torch's import alone maps ~1 GB of VmSize, glibc reserves 64 MB per malloc arena), so
  it would fail runs that fit; a cgroup would count page cache and needs a writable cgroup
  tree, which these machines (cgroup v1, read-only) do not give a job.
  Caveats: RLIMIT_DATA counts memory that is mapped, not only touched (VmData >= the
  anonymous part of RSS); read-only file mappings (shared libraries, an mmap-ed
  safetensors file) are not counted although RSS shows them; children of the rank
  (a JIT compiler) inherit the limit; an allocation that fails inside a C++ thread
  (gloo) aborts the process instead of raising, which the launcher reports as a failed
  run, not as `oom`.

Peaks: the load-phase peak is the process's high-water mark from start to the first
step (CPU: VmHWM of /proc/self/status; CUDA: torch.cuda.max_memory_allocated/reserved and
NVML); then the marks are reset (/proc/self/clear_refs "5", torch.cuda.reset_peak_memory_stats)
so the training-phase peak covers the steps alone.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

OOM_EXIT_CODE = 75
GIB = 2**30

# Messages of allocation failures that do not arrive as torch.OutOfMemoryError / MemoryError.
_OOM_MARKERS = ("can't allocate memory", "Cannot allocate memory", "std::bad_alloc", "out of memory")


def process_status() -> dict:
    """VmHWM, VmRSS, VmData, VmSize of this process in bytes (Linux /proc/self/status)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    out = {}
    for key in ("VmHWM", "VmRSS", "VmData", "VmSize"):
        found = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
        if found:
            out[key] = int(found.group(1)) * 1024
    return out


def reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: clear_refs '5'); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def nvml_used_bytes(device_index: int) -> int:
    """Device memory in use as NVML sees it (every process and the CUDA context): the one
    place that reads NVML, so the handle lookup can be swapped (distlab.hardware)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


def _cuda_peaks(device) -> dict:
    out = {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    try:
        out["nvml_used_bytes"] = nvml_used_bytes(device.index)
    except Exception as exc:  # recorded, not hidden
        out["nvml_error"] = str(exc)
    return out


def phase_peak(device) -> dict:
    """Peak memory of this process since the last reset (or since start)."""
    status = process_status()
    out = {"rss_peak_bytes": status.get("VmHWM"), "data_bytes_now": status.get("VmData")}
    if device.type == "cuda":
        out.update(_cuda_peaks(device))
    return out


def load_phase_record(device) -> dict:
    """Called once right before the first step: the load-phase peak (process start, imports,
    model load, sharding, optimizer), then the peaks are reset for the training phase."""
    out = phase_peak(device)
    out["how"] = ("high-water mark from process start to the first step: VmHWM of /proc/self/status"
                  + ("; torch.cuda.max_memory_allocated/reserved and NVML used" if device.type == "cuda" else ""))
    out["reset_for_training"] = reset_rss_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return out


def memory_record(ctx, load_phase: dict | None = None) -> dict:
    """This rank's memory after training: the training-phase peak beside the load-phase one."""
    from distlab import metrics as M

    training = phase_peak(ctx.device)
    out = {"peak_rss_bytes": M.peak_rss_bytes(), "load_phase": load_phase, "training_phase": training}
    if load_phase is not None:
        training["how"] = ("VmHWM since the reset right before the first step" if load_phase["reset_for_training"]
                           else "VmHWM since process start (clear_refs refused: includes the load phase)")
    if ctx.device.type == "cuda":
        out.update({k: v for k, v in training.items() if k.startswith(("cuda_", "nvml_"))})
    return out


def apply_memory_budget(ctx) -> dict | None:
    """Enforce memory_budget_gib on this rank process (see the module docstring)."""
    gib = ctx.spec["memory_budget_gib"]
    if gib is None:
        return None
    budget = int(gib * GIB)
    if ctx.device.type == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), ctx.device)
        return {"bytes": budget, "enforced": True,
                "how": "torch.cuda.set_per_process_memory_fraction(budget / device total)"}
    import resource

    before = process_status().get("VmData")
    resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
    return {"bytes": budget, "enforced": True, "data_bytes_when_set": before,
            "how": "resource.setrlimit(RLIMIT_DATA) in the rank process (whole process: interpreter, libraries, "
                   "tensors); an allocation past it fails and the run ends with status oom"}


def budget_verdict(budget: dict | None, memory: dict, state_bytes: dict | None) -> dict | None:
    """The budget beside what the rank really used (it finished, so on an enforced budget it fit)."""
    if budget is None:
        return None
    verdict = dict(budget)
    if "cuda_max_reserved_bytes" in memory:
        load = (memory.get("load_phase") or {}).get("cuda_max_reserved_bytes") or 0
        verdict["measured_bytes"] = max(memory["cuda_max_reserved_bytes"], load)
        verdict["measured_what"] = "torch.cuda.max_memory_reserved, load and training phases"
    else:
        peaks = [memory["peak_rss_bytes"], (memory.get("load_phase") or {}).get("rss_peak_bytes") or 0]
        verdict["measured_bytes"] = max(peaks)
        verdict["measured_what"] = "peak RSS of the whole rank process (getrusage ru_maxrss)"
        verdict["model_state_bytes"] = sum(v for v in (state_bytes or {}).values() if isinstance(v, int))
    verdict["fits"] = verdict["measured_bytes"] <= budget["bytes"] or budget["enforced"]
    return verdict


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def data_limit_bytes() -> int | None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure anywhere in the exception chain: torch's CUDA OOM, Python's
    MemoryError, the CPU allocator's RuntimeError (what RLIMIT_DATA produces), or, under a
    data limit, CPython's SystemError from a C extension whose malloc failed (seen when an
    import runs past the limit)."""
    limited = data_limit_bytes() is not None
    for item in _chain(error):
        if isinstance(item, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(item, RuntimeError) and any(marker in str(item) for marker in _OOM_MARKERS):
            return True
        if limited and isinstance(item, SystemError) and "without exception set" in str(item):
            return True
    return False


def record_oom(job: dict, error: BaseException) -> None:
    """A rank that ran out of memory leaves oom-rank<N>.json; the launcher turns that into
    a metrics.json with status 'oom' so the pipeline goes on and the report shows it."""
    rank = int(os.environ.get("RANK", 0))
    memory: dict = {"process": process_status(),
                    "rlimit_data_bytes": data_limit_bytes()}
    if torch.cuda.is_available():
        try:
            memory.update({"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(),
                           "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved()})
        except Exception as exc:
            memory["error"] = str(exc)
    record = {"rank": rank, "error_type": type(error).__name__,
              "error": (str(error).splitlines() or [""])[0][:500], "memory": memory}
    Path(job["run_dir"], f"oom-rank{rank}.json").write_text(json.dumps(record))
