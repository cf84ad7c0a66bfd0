"""collectives.json as later phases read it (distlab.tools.collectives measures and writes it):
the collectives it times, the time of one at any message size, and what the all-reduce's time
means for data parallelism. Torch-free, so the report reads it without the benchmark's module."""
from __future__ import annotations

import math

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def time_at(result: dict, op: str, backend: str, size_bytes: float) -> float | None:
    """Measured time of `op` for a message of size_bytes, interpolated log-log between the
    two nearest measured sizes (extrapolated at constant bandwidth past the largest)."""
    points = sorted((r["size_bytes"], r["time_s_median"]) for r in result["results"]
                    if r["op"] == op and r["backend"] == backend and r["status"] == "ok")
    if not points:
        return None
    if size_bytes <= points[0][0]:
        return points[0][1]
    if size_bytes >= points[-1][0]:
        return points[-1][1] * size_bytes / points[-1][0]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= size_bytes <= s1:
            w = (math.log(size_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
    return None


def break_even_global_batch(seconds_per_sample: float, allreduce_s: float, world: int) -> float:
    """Global batch B above which `world` data-parallel ranks finish a step sooner than one.

    One rank: B*c. N ranks, no compute/communication overlap: B*c/N + a. Equal at
    B* = a*N / (c*(N-1)). DDP overlaps the all-reduce with backward, so B* is an upper bound.
    """
    if world < 2:
        raise ValueError("break-even needs at least 2 ranks")
    return allreduce_s * world / (seconds_per_sample * (world - 1))
