"""One module per roadmap stage (`stage<N>_<name>.py`), each with build(runs) -> Card.

A module may set TASK (default causal-lm): it then sees only that task's runs.
Goals are computed from measured runs only: passed, failed (ran but missed the goal), not
run, compared, not enforced (a limit the runs were only compared with after the fact, so
they cannot pass it), or doubtful (a figure the setup cannot produce, with its likely cause). Modules
are discovered, so adding a stage touches no registry.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field

from distlab.records.run_outputs import DEFAULT_TASK, task_of
from distlab.report.report_run import ReportRun

PASSED, FAILED, NOT_RUN, COMPARED = "passed", "failed", "not run", "compared, not enforced"
# Measured, but the figure contradicts what the setup allows (a speedup above linear, offload
# faster than none): shown with its likely cause, never passed.
DOUBTFUL = "doubtful"


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
    stats = run.throughput_spread
    if stats:
        return stats.median, stats.low, stats.high
    tokens, st = run.throughput.tokens_per_step, run.timing.step_time_s
    return tokens / st["median"], tokens / st["p75"], tokens / st["p25"]


# A spread from one process: step-time windows (spec `repeats`, windows of one launch, not
# independent runs) or the step-time interquartile range. Spec `launches` gives separate launches.
SPREAD_CAVEAT = ("spreads are within one process (its timed steps split into windows, spec 'repeats', or their "
                 "interquartile range); run-to-run variance across separate launches was not measured (set "
                 "'launches' to 2 or more for that), so a 'faster' here may not survive a rerun")


def is_busy(run) -> bool:
    """Timed while other processes needed cores the run had not left free (distlab.runtime.noise), in
    its launch or any of its further launches (spec launches)."""
    return any((n or {}).get("busy") for n in [run.noise, *(x.get("noise") for x in run.launches)])


def plain_speed(run) -> bool:
    """Whether a run's step time is its strategy's and batch's alone: no activation
    checkpointing (recomputes forwards), no torch.compile (other kernels), no profiler (traces
    its steps). Only such runs stand for a world size in a 1-vs-N comparison."""
    spec = run.spec
    return (spec.activation_checkpointing or "none") == "none" and not spec.compile and not spec.profile


def spread_caveat(runs: list[ReportRun]) -> str:
    """Where the compared spreads come from: separate launches only when every run had 2+."""
    if runs and all(len(r.launches) >= 2 for r in runs):
        return ("spreads are the min-max over separate launches (spec 'launches'): run-to-run variance "
                "measured")
    return SPREAD_CAVEAT


def load_cell(run) -> str:
    """A table cell saying how quiet the machine was while the run's steps were timed."""
    noise = run.noise or {}
    if noise.get("busy") is None:
        return "not recorded"
    return f"{'BUSY' if noise['busy'] else 'quiet'} (others {noise['others_cores']:.1f} cores)"


def noise_cause(runs: list[ReportRun]) -> str:
    """The likely cause of an implausible ratio between these runs, from their noise records."""
    busy = [r for r in runs if is_busy(r)]
    if busy:
        return ("likely cause: the machine was busy while " + ", ".join(
            f"{r.experiment} was timed (other processes used {r.noise.others_cores:.1f} cores, "
            f"{r.noise.free_cores} left free)" for r in busy) + "; its step times include waiting for a core")
    return ("likely cause: noise between single launches (one launch each, no independent repeats); nothing else "
            "on the machine was recorded during the timed steps" if all((r.noise or {}).get("busy") is False
                                                                         for r in runs) else
            "likely cause: noise (the machine's load was not recorded for these runs)")


def comm_ms(run) -> float | str:
    """Median collective time per step in ms, or "not measured" (never a 0 standing in for null)."""
    seconds = run.timing.comm_inflight_s_per_step.median
    return "not measured" if seconds is None else round(seconds * 1000, 2)


def metrics_link(run) -> str:
    """A run's metrics.json: the evidence link of a goal about that run."""
    return os.path.join(run.folder, "metrics.json")


def ok_runs(runs: list[ReportRun], stage: str) -> list[ReportRun]:
    return [r for r in runs if r.stage == stage and r.status == "ok"]


PHASES_HOW = ("load: process start (interpreter, libraries) to the first step, model load and sharding included; "
              "training: the steps alone (peak reset before step 0); save: the final evaluation, checkpoint save "
              "and export alone (peak reset after the last step; the export gathers one decoder layer at a time). "
              "CPU: VmHWM (peak RSS) of the rank process; CUDA: torch.cuda.max_memory_reserved. distlab.runtime.memory")


def phase_peak_table(runs: list[ReportRun], title: str, extra=None) -> Table:
    """Load, training and save peaks of every rank of `runs` (MiB); extra(run) adds columns."""
    import pandas as pd

    from distlab.records.memory_phases import PHASES, rank_phase_peaks

    rows = []
    for run in runs:
        for rank, record in enumerate((run.memory or {}).get("per_rank") or []):
            peaks = rank_phase_peaks(record)
            rows.append({"run": run.experiment, "rank": rank, "ranks": run.as_built.world_size,
                         **{f"{phase.split('_')[0]} peak (MiB)": round(peaks[phase] / 2**20, 1)
                            if peaks[phase] is not None else None for phase in PHASES},
                         **(extra(run) if extra else {})})
    return Table(title, pd.DataFrame(rows), PHASES_HOW)


def run_task(run) -> str:
    """The task a run trained (distlab/tasks); runs written before tasks existed are causal LMs."""
    return task_of(run.spec)


def all_cards(runs: list[ReportRun]) -> list[Card]:
    """Each card gets the runs of its task (a module's TASK, default causal-lm): the stage cards
    of causal LMs never see a text-to-image run, whichever stage block it sits in."""
    cards = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("stage"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            task = getattr(module, "TASK", DEFAULT_TASK)
            mine = [r for r in runs if run_task(r) == task]
            card = module.build(mine)
            lesson = getattr(module, "LESSON", None)  # (stage, whether its runs must train what DDP trains)
            if lesson:
                from distlab.report.cards.parity import lesson_goal

                card.goals.insert(0, lesson_goal(lesson[0], mine, lesson[1]))
            cards.append(card)
    return sorted(cards, key=lambda c: c.number)
