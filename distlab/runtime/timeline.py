"""Where one rank's wall time goes, from process start to its last collective: a mark at each
phase boundary (imports, process group, model ready, first step, steps done, eval, save),
with the process CPU time at each. The fixed costs around the timed steps are what a short
run mostly pays for (benchmarks/harness_overhead.py)."""
from __future__ import annotations

import time

HOW = ("seconds since the rank process started (psutil create_time; a warm start's: its stand-in's, "
       "distlab.launchers.warm_start) at each phase boundary, on rank 0; cpu_s: its process CPU time "
       "(every thread; a warm copy's from its fork) at that mark")


class Timeline:
    def __init__(self):
        from distlab.launchers import warm_start

        self.origin = warm_start.process_started()
        self.start = warm_start.start_record()
        self.marks: list[tuple[str, float, float]] = []

    def after_imports(self) -> "Timeline":
        """A copy holding only the first mark (imports): one per run in a process that runs
        several (a Ray worker restarted in place)."""
        copy = Timeline.__new__(Timeline)
        copy.origin, copy.start, copy.marks = self.origin, self.start, self.marks[:1]
        return copy

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time() - self.origin, time.process_time()))

    def record(self) -> dict:
        """{phases: [{phase, end_s, wall_s, cpu_s}], how}: each phase ends at its mark."""
        phases, before, cpu_before = [], 0.0, 0.0
        for name, at, cpu in self.marks:
            phases.append({"phase": name, "end_s": round(at, 3), "wall_s": round(at - before, 3),
                           "cpu_s": round(cpu - cpu_before, 3)})
            before, cpu_before = at, cpu
        return {"phases": phases, "start": self.start, "how": HOW}
