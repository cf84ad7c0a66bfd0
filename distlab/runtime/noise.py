"""What else the machine did while a run's steps were timed (pyperf's habit: record the load
while measuring and say when a figure cannot be trusted).

Each rank reads, at the start of its first timed step and after its last step, the machine's
busy CPU time (/proc/stat: user, nice, system, irq, softirq, steal over every core), its own
process CPU time (every thread) and the load average. Rank 0 then subtracts what all ranks
used from what the machine used over the same window: the rest is other processes (another
job, another user, the launcher). A run is marked busy when those others needed more cores
than the run left free: then the run's ranks waited for a core and its step times are inflated
by an amount the run cannot know.
"""
from __future__ import annotations

import os
import time

# Other processes may use this many cores beyond the free ones (launcher, daemons, the
# workflow engine) before a run counts as measured on a busy machine.
BUSY_MARGIN_CORES = 0.2
HOW = ("others' CPU = the machine's busy CPU time (/proc/stat) minus every rank's own process CPU time, over "
       "the timed steps (rank 0's window); busy when others used more cores on average than the run left "
       f"free (machine cores - ranks x threads) plus {BUSY_MARGIN_CORES} core; load average = os.getloadavg() 1-min "
       "at the first timed step and after the last")


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine spent not idle since boot (None off Linux)."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class NoiseProbe:
    """One rank's window over the timed steps: start() before the first, stop() after the last."""

    def __init__(self):
        self.start_mark = None
        self.record = None

    def start(self) -> None:
        self.start_mark = (time.perf_counter(), machine_busy_seconds(), time.process_time(), os.getloadavg()[0])

    def stop(self) -> dict | None:
        if self.start_mark is None:
            return None  # no timed step ran in this launch (a resume past the last one)
        wall0, machine0, own0, load0 = self.start_mark
        machine1 = machine_busy_seconds()
        self.record = {"wall_s": time.perf_counter() - wall0,
                       "machine_cpu_s": None if machine0 is None or machine1 is None else machine1 - machine0,
                       "own_cpu_s": time.process_time() - own0, "load_avg_1min": [load0, os.getloadavg()[0]]}
        return self.record


def summarize_noise(per_rank: list[dict | None], job_cores: int, cores: int | None = None, how: str = HOW) -> dict:
    """The run's noise record from every rank's window (rank 0's wall and machine view); the
    compute probe's too (distlab.tools.compute_probe: its process and its forked neighbours)."""
    cores = cores or machine_cores()
    first = per_rank[0] if per_rank else None
    if not first or first["machine_cpu_s"] is None or not first["wall_s"]:
        return {"busy": None, "why": "no timed window, or /proc/stat unreadable", "how": how}
    own = sum(r["own_cpu_s"] for r in per_rank if r)
    others = max(0.0, first["machine_cpu_s"] - own)
    others_cores = others / first["wall_s"]
    free = max(0, cores - job_cores)
    busy = others_cores > free + BUSY_MARGIN_CORES
    return {"busy": busy, "others_cpu_s": round(others, 3), "others_cores": round(others_cores, 3),
            "ranks_cpu_s": round(own, 3), "window_s": round(first["wall_s"], 3), "machine_cores": cores,
            "job_cores": job_cores, "free_cores": free, "load_avg_1min": [round(v, 2) for v in first["load_avg_1min"]],
            "how": how}


def noise_text(noise: dict | None) -> str:
    """One phrase for a table cell or a note: 'quiet' or 'BUSY: others used 1.3 cores (load 3.1)'."""
    if not noise or noise.get("busy") is None:
        return "not recorded"
    load = max(noise["load_avg_1min"])
    if noise["busy"]:
        return (f"BUSY: other processes used {noise['others_cores']:.2f} cores of {noise['machine_cores']} "
                f"({noise['free_cores']} left free; load {load:.1f})")
    return f"quiet (others {noise['others_cores']:.2f} cores; load {load:.1f})"
