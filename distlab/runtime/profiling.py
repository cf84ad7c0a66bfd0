"""`profile: {steps: [a, b]}`: a torch.profiler trace of optimizer steps a..b on every rank, and
on CUDA a memory snapshot, written under the run's run_files/profile/.

- Trace: run_files/profile/rank<R>.pt.trace.json, Chrome trace format (export_chrome_trace):
  opens in Perfetto (ui.perfetto.dev) and chrome://tracing, and TensorBoard's profiler plugin
  reads `*.pt.trace.json` in the folder it is pointed at. Each step is one `step <N>` range.
- Memory snapshot (CUDA only): torch.cuda.memory._record_memory_history from the rank's start,
  dumped to run_files/profile/memory-rank<R>.pickle after step b (memory_viz at
  pytorch.org/memory_viz opens it), and to memory-oom-rank<R>.pickle when the rank runs out of
  memory. The CPU allocator has no such history: a CPU run says so in its record.

The profiled steps' times include the profiler's own overhead; the record names them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from distlab.records.spec import Spec
from distlab.records.run_layout import RUN_FILES, run_files_dir

PROFILE_DIR = "profile"
# Allocation events kept by the CUDA memory history (its ring buffer): bounded host memory.
MEMORY_HISTORY_ENTRIES = 100_000
CPU_NO_SNAPSHOT = ("no memory snapshot: torch.cuda.memory._record_memory_history records the CUDA caching "
                   "allocator only, and this run is on the CPU")


def profile_dir(run_dir) -> Path:
    return run_files_dir(run_dir) / PROFILE_DIR


class StepProfiler:
    """The loop calls before_step / after_step around every step; both are no-ops
    when the spec asks for no profile. start() begins the CUDA memory history (at rank start,
    so an out-of-memory error in the model's load is in it too)."""

    def __init__(self, spec: Spec, run_dir, rank: int, device: torch.device):
        self.steps = tuple(spec.profile["steps"]) if spec.profile else None
        self.folder, self.rank, self.cuda = profile_dir(run_dir), rank, device.type == "cuda"
        self.profiler = None
        self.step_range = None  # the open `step <N>` range of the trace
        self.recording_memory = False
        self.record: dict | None = None
        if self.steps:
            self.record = {"steps": list(self.steps), "rank": rank, "trace": None, "profiled_steps": [],
                           "memory_snapshot": None, "memory_snapshot_note": None if self.cuda else CPU_NO_SNAPSHOT,
                           "how": "torch.profiler.profile (CPU" + (" and CUDA" if self.cuda else "")
                                  + " activities) started before step a and stopped after step b, "
                                    "export_chrome_trace; those steps' times include the profiler's overhead"}

    def start(self) -> None:
        global _RECORDING
        if self.steps and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self.recording_memory = True
            _RECORDING = self

    def before_step(self, step: int) -> None:
        """Start the profiler before the window's first step (a resumed run that starts inside the
        window profiles the steps left), and open the step's named range in the trace."""
        if not self.steps or self.record["trace"] or not self.steps[0] <= step <= self.steps[1]:
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.start()
        self.step_range = torch.profiler.record_function(f"step {step}")
        self.step_range.__enter__()
        self.record["profiled_steps"].append(step)

    def after_step(self, step: int) -> bool:
        """Close the step's range; after the window's last step stop and write the trace (and on
        CUDA the memory snapshot). Returns whether the step was profiled."""
        if self.step_range is None:
            return False
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step >= self.steps[1]:
            self.profiler.stop()
            trace = self.folder / f"rank{self.rank}.pt.trace.json"
            self.profiler.export_chrome_trace(str(trace))
            self.profiler = None
            self.record["trace"] = str(trace)
            if self.recording_memory:
                self.record["memory_snapshot"] = self.dump_memory("memory")
        return True

    def dump_memory(self, name: str) -> str | None:
        if not self.recording_memory:
            return None
        path = self.folder / f"{name}-rank{self.rank}.pickle"
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return str(path)



# The rank's profiler while it records CUDA memory history: distlab.runtime.memory.record_oom
# (every out-of-memory path of a rank ends there) dumps it.
_RECORDING: StepProfiler | None = None


def snapshot_after_oom() -> str | None:
    """The rank ran out of memory: its CUDA memory history so far (memory-oom-rank<R>.pickle,
    for memory_viz), when a profile asked for one; else None."""
    try:
        return _RECORDING.dump_memory("memory-oom") if _RECORDING is not None else None
    except Exception as exc:  # noqa: BLE001 - the OOM record must still be written
        return f"not written: {type(exc).__name__}: {exc}"[:300]


def profile_record(per_rank: list[dict | None]) -> dict | None:
    """Rank 0: every rank's profile record as metrics.json's `profile` (None when off), its
    files relative to the run folder; printed to the job log too, the CPU's missing memory
    snapshot included."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return None

    def relative(path):
        return None if path is None else str(Path(RUN_FILES, PROFILE_DIR, Path(path).name))

    out = {"steps": ranks[0]["steps"], "folder": str(Path(RUN_FILES, PROFILE_DIR)),
           "traces": [relative(r["trace"]) for r in ranks],
           "memory_snapshots": [relative(r["memory_snapshot"]) for r in ranks],
           "profiled_steps": ranks[0]["profiled_steps"], "memory_snapshot_note": ranks[0]["memory_snapshot_note"],
           "open_with": "Perfetto (ui.perfetto.dev) or chrome://tracing: open a trace file; TensorBoard: "
                        f"tensorboard --logdir <run>/{RUN_FILES}/{PROFILE_DIR} (torch profiler plugin); CUDA memory "
                        "snapshots: pytorch.org/memory_viz",
           "how": ranks[0]["how"]}
    print(f"profile: steps {out['steps'][0]}..{out['steps'][1]} traced on {len(ranks)} rank(s) into "
          f"{out['folder']}/ ({', '.join(Path(t).name for t in out['traces'] if t)})"
          + (f"; {out['memory_snapshot_note']}" if out["memory_snapshot_note"] else ""), flush=True)
    return out
