"""One rank's memory: the per-rank budget (enforced on CUDA and on CPU), the load-phase and
training-phase peaks, and the record a rank leaves when it runs out of memory.

The budget (`memory_budget_gib`) counts the whole rank process, as a machine's RAM would:
interpreter, torch/transformers/deepspeed and their libraries included (a warm-started CPU
rank, distlab.launchers.warm_start, counts the pages of its server's imports it touches).

- CUDA: `torch.cuda.set_per_process_memory_fraction(budget / device total)`; the caching
  allocator refuses past it (torch.OutOfMemoryError).
- CPU: a watchdog thread in the rank process (BudgetWatchdog) reads the process's RSS
  high-water mark (VmHWM of /proc/self/status) every 10 ms; once it passes the budget the
  rank records the OOM (record_oom) and exits with OOM_EXIT_CODE, as a cgroup memory limit
  or the kernel's OOM killer would end it; distlab.jobs.launch then writes a metrics.json with
  status `oom` and the pipeline goes on. The high-water mark is kept by the kernel, so a
  spike between two polls is still seen (up to 10 ms late); the phase boundaries and the
  end of the run check it synchronously too. Python's MemoryError and the CPU allocator's
  "can't allocate memory" RuntimeError are caught as OOM as well (is_out_of_memory).
  Why not the alternatives (tried on this machine): RLIMIT_AS counts reserved address space
  (torch's import alone maps ~1 GB of VmSize); RLIMIT_DATA counts every private writable
  mapping, including 8 MB thread stacks and malloc arenas: a 2-rank ZeRO-3 rank of the
  default model showed VmData 3.5 GB at 0.6 GB of RSS (1.5 GB vs 0.5 GB for a 1-rank
  ZeRO-0 rank), so it would charge a sharded rank for threads, not memory; a cgroup would
  be exact but these machines give a job no writable cgroup tree (cgroup v1, read-only).
  Caveats: RSS includes file pages the process maps (shared libraries, an mmap-ed
  safetensors file while it is read), as a machine's RAM would; a rank can overshoot the
  budget for up to one poll interval before it is stopped; the watchdog needs the GIL,
  which torch's kernels release.

Peaks: the load-phase peak is the process's high-water mark from start to the first
step (CPU: VmHWM of /proc/self/status; CUDA: torch.cuda.max_memory_allocated/reserved and
NVML); then the marks are reset (/proc/self/clear_refs "5", torch.cuda.reset_peak_memory_stats)
so the training-phase peak covers the steps alone; they are reset again after the last step,
so the save-phase peak covers the final evaluation, save and export alone; each rank's
lifetime peak (the largest of the three) joins the record and the budget verdict. (getrusage's
ru_maxrss is no lifetime peak here: clear_refs resets the kernel's high-water mark it reads.)

Over ~300 lines on purpose: the budget, the phase peaks and the OOM record read the same
high-water marks, and must agree on what "the rank's memory" is.
"""
from __future__ import annotations

import copy

import json
import os
import re
from pathlib import Path

import torch

from distlab.runtime import host_allocator
from distlab.records.memory_phases import rank_phase_peaks

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


def nvml_used_bytes(device) -> int:
    """Device memory in use as NVML sees it (every process and the CUDA context) on the
    physical board behind `device`, found by UUID / PCI bus id (never the CUDA ordinal)."""
    import pynvml

    from distlab.configuration.hardware import nvml_handle

    pynvml.nvmlInit()
    try:
        handle = nvml_handle(device, pynvml)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


def _cuda_peaks(device) -> dict:
    out = {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
           "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    try:
        out["nvml_used_bytes"] = nvml_used_bytes(device)
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


def rss_now() -> int | None:
    """This process's RSS now (the worker reads it before the model loads: the process's own cost)."""
    return process_status().get("VmRSS")


def load_phase_record(device, rss_before_model: int | None = None) -> dict:
    """Called once right before the first step: the load-phase peak (process start, imports,
    model load, sharding, optimizer), then the peaks are reset for the training phase."""
    check_budget()  # before the reset below forgets the load-phase high-water mark
    out = phase_peak(device)
    out["rss_before_model_bytes"] = rss_before_model
    out["how"] = ("high-water mark from process start to the first step: VmHWM of /proc/self/status"
                  + ("; torch.cuda.max_memory_allocated/reserved and NVML used" if device.type == "cuda" else ""))
    out["reset_for_training"] = reset_rss_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return out


def memory_record(ctx, load_phase: dict | None = None) -> dict:
    """This rank's memory after training: the training-phase peak beside the load-phase one."""
    from distlab.records import metrics as M

    check_budget()
    training = phase_peak(ctx.device)
    out = {"peak_rss_bytes": M.peak_rss_bytes(), "load_phase": load_phase, "training_phase": training}
    if load_phase is not None:
        training["how"] = ("VmHWM since the reset right before the first step" if load_phase["reset_for_training"]
                           else "VmHWM since process start (clear_refs refused: includes the load phase)")
    if ctx.device.type == "cuda":
        out.update({k: v for k, v in training.items() if k.startswith(("cuda_", "nvml_"))})
    else:  # what RSS means here depends on them
        from distlab.launchers.warm_start import start_record

        out["host_allocator"] = host_allocator.record()
        # A warm copy's RSS counts only the pages it touched of what its server imported.
        out["start"] = start_record()
    return out


class BudgetWatchdog:
    """Ends this rank as `oom` once its RSS high-water mark passes the budget (CPU)."""

    interval_s = 0.01

    def __init__(self, budget_bytes: int, run_dir: str):
        import threading

        self.budget, self.run_dir, self.peak = budget_bytes, run_dir, 0
        self._thread = threading.Thread(target=self._watch, name="distlab-memory-budget", daemon=True)
        self._thread.start()

    def check(self) -> int:
        """The peak so far; never returns when it is past the budget."""
        self.peak = max(self.peak, process_status().get("VmHWM", 0))
        if self.peak > self.budget:
            record_oom(self.run_dir, MemoryError(
                f"rank process RSS peak {self.peak / GIB:.3f} GiB passed the memory budget "
                f"{self.budget / GIB:.3f} GiB (distlab.runtime.memory.BudgetWatchdog)"))
            os._exit(OOM_EXIT_CODE)  # peers may sit in a collective: torchrun tears the group down
        return self.peak

    def _watch(self) -> None:
        import time

        while True:
            self.check()
            time.sleep(self.interval_s)


_WATCHDOG: BudgetWatchdog | None = None


def check_budget() -> int | None:
    """Synchronous check (phase boundaries): the watched peak, None without a CPU budget."""
    return _WATCHDOG.check() if _WATCHDOG is not None else None


def apply_memory_budget(ctx) -> dict | None:
    """Enforce memory_budget_gib on this rank process (see the module docstring). Every CPU
    rank, budget or not, first gets the mmap threshold its model calls for (distlab.runtime.host_allocator)."""
    global _WATCHDOG
    if ctx.device.type == "cpu":
        host_allocator.apply(ctx.job.model_source if ctx.job is not None else None)
    gib = ctx.spec.memory_budget_gib
    if gib is None:
        return None
    budget = int(gib * GIB)
    if ctx.device.type == "cuda":
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), ctx.device)
        return {"bytes": budget, "enforced": True,
                "how": "torch.cuda.set_per_process_memory_fraction(budget / device total)"}
    _WATCHDOG = BudgetWatchdog(budget, ctx.run_dir)
    return {"bytes": budget, "enforced": True, "rss_when_set": process_status().get("VmRSS"),
            "how": "RSS watchdog in the rank process (VmHWM every 10 ms; whole process: interpreter, libraries, "
                   "tensors)"}


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
    verdict["fits"] = verdict["measured_bytes"] <= budget["bytes"]
    return verdict


def start_save_phase(device) -> bool:
    """Right after training: reset the peaks so the save phase (final evaluation, save and
    export) is measured alone. False where the kernel refused the reset."""
    check_budget()  # before the reset forgets the training-phase high-water mark
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return reset_rss_peak()


def gather_peaks_through_save(device, reset_for_save: bool | None = None) -> list:
    """Collective: every rank's save-phase peak, on every rank."""
    import torch.distributed as dist

    check_budget()
    save_phase = phase_peak(device)
    save_phase["how"] = ("VmHWM since the reset after the last step: final evaluation, save and export"
                         if reset_for_save else "VmHWM since process start (clear_refs refused)")
    if device.type == "cuda":
        save_phase["how"] += "; torch.cuda.max_memory_allocated/reserved since the same point"
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, save_phase)
    return peaks


def with_peaks_through_save(memory: dict, peaks: list) -> dict:
    """The run summary's memory record (a new one) whose per-rank records gain the save-phase
    peak and the lifetime peak (the largest phase peak: load, training, save); a budget's verdict
    then covers the save and export too (they run after the training peak was recorded, under
    the same enforced budget)."""
    memory = copy.deepcopy(memory)
    for record, save_phase in zip(memory["per_rank"], peaks):
        record["save_phase"] = save_phase
        phases = [v for v in rank_phase_peaks(record).values() if v is not None]
        lifetime = max(phases) if phases else None
        record["peak_through_save_bytes"] = lifetime
        verdict = record.get("budget")
        if verdict is None or lifetime is None:
            continue
        verdict["measured_bytes"] = max(verdict["measured_bytes"], lifetime)
        verdict["measured_what"] += ", through the final save and export"
        verdict["fits"] = verdict["measured_bytes"] <= verdict["bytes"]
    return memory


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
    MemoryError, the CPU allocator's RuntimeError, or, under a data rlimit, CPython's
    SystemError from a C extension whose malloc failed (seen when an import ran past one)."""
    limited = data_limit_bytes() is not None
    for item in _chain(error):
        if isinstance(item, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(item, RuntimeError) and any(marker in str(item) for marker in _OOM_MARKERS):
            return True
        if limited and isinstance(item, SystemError) and "without exception set" in str(item):
            return True
    return False


def record_oom(run_dir: str, error: BaseException) -> None:
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
    from distlab.runtime.profiling import snapshot_after_oom

    record["memory_snapshot"] = snapshot_after_oom()  # profile: on CUDA, the allocations up to this error
    Path(run_dir, f"oom-rank{rank}.json").write_text(json.dumps(record))

