"""One module per roadmap stage (`stage<N>_<name>.py`), each with build(runs) -> Card.

Goals are computed from measured runs only: passed, failed (ran but missed the goal), not
run, or compared, not enforced (a limit the runs were only compared with after the fact, so
they cannot pass it). Modules are discovered, so adding a stage touches no registry.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field

PASSED, FAILED, NOT_RUN, COMPARED = "passed", "failed", "not run", "compared, not enforced"


@dataclass
class Goal:
    kind: str  # "minimal" or "bonus"
    text: str
    status: str
    evidence: str = ""
    links: list[str] = field(default_factory=list)


@dataclass
class Figure:
    title: str
    png_b64: str
    how: str


@dataclass
class Table:
    title: str
    frame: object  # pandas DataFrame
    how: str = ""


@dataclass
class Card:
    number: int
    title: str
    goals: list[Goal] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def tokens_per_s(run) -> tuple[float, float, float]:
    """(median, low, high) tokens/s: collect's spread over repeats when it computed one,
    else from the step-time interquartile range."""
    stats = run.get("_throughput")
    if stats:
        return stats["median"], stats["low"], stats["high"]
    tokens, st = run["throughput"]["tokens_per_step"], run["timing"]["step_time_s"]
    return tokens / st["median"], tokens / st["p75"], tokens / st["p25"]


# Every spread the report compares comes from one process: step-time windows (spec `repeats`,
# which are windows of one launch, not independent runs) or the step-time interquartile range.
SPREAD_CAVEAT = ("spreads are within one process (its timed steps split into windows, spec 'repeats', or their "
                 "interquartile range); run-to-run variance across separate launches was not measured, so a "
                 "'faster' here may not survive a rerun")


def comm_ms(run) -> float | str:
    """Median collective time per step in ms, or "not measured" (never a 0 standing in for null)."""
    seconds = run["timing"]["comm_inflight_s_per_step"]["median"]
    return "not measured" if seconds is None else round(seconds * 1000, 2)


def metrics_link(run) -> str:
    """A run's metrics.json: the evidence link of a goal about that run."""
    return os.path.join(run["_dir"], "metrics.json")


def ok_runs(runs: list[dict], stage: str) -> list[dict]:
    return [r for r in runs if r["stage"] == stage and r.get("status") == "ok"]


PHASES_HOW = ("load: process start (interpreter, libraries) to the first step, model load and sharding included; "
              "training: the steps alone (peak reset before step 0); save: the final evaluation, checkpoint save "
              "and export alone (peak reset after the last step; the export gathers one decoder layer at a time). "
              "CPU: VmHWM (peak RSS) of the rank process; CUDA: torch.cuda.max_memory_reserved. distlab.memory")


def phase_peak_table(runs: list[dict], title: str, extra=None) -> Table:
    """Load, training and save peaks of every rank of `runs` (MiB); extra(run) adds columns."""
    import pandas as pd

    from distlab.memory import PHASES, rank_phase_peaks

    rows = []
    for run in runs:
        for rank, record in enumerate((run.get("memory") or {}).get("per_rank") or []):
            peaks = rank_phase_peaks(record)
            rows.append({"run": run["experiment"], "rank": rank, "ranks": run["as_built"]["world_size"],
                         **{f"{phase.split('_')[0]} peak (MiB)": round(peaks[phase] / 2**20, 1)
                            if peaks[phase] is not None else None for phase in PHASES},
                         **(extra(run) if extra else {})})
    return Table(title, pd.DataFrame(rows), PHASES_HOW)


def all_cards(runs: list[dict]) -> list[Card]:
    cards = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("stage"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            cards.append(module.build(runs))
    return sorted(cards, key=lambda c: c.number)
