"""One module per roadmap stage (`stage<N>_<name>.py`), each with build(runs) -> Card.

A module may set TASK (default causal-lm): it then sees only that task's runs.
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


def run_task(run) -> str:
    """The task a run trained (distlab/tasks); runs written before tasks existed are causal LMs."""
    return run["spec"].get("task", "causal-lm")


def all_cards(runs: list[dict]) -> list[Card]:
    """Each card gets the runs of its task (a module's TASK, default causal-lm): the stage cards
    of causal LMs never see a text-to-image run, whichever stage block it sits in."""
    cards = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("stage"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            task = getattr(module, "TASK", "causal-lm")
            cards.append(module.build([r for r in runs if run_task(r) == task]))
    return sorted(cards, key=lambda c: c.number)
