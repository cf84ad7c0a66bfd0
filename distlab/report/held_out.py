"""Held-out evaluation as the report reads it (the ranks measure it: distlab.runtime.evaluation):
the stage cards' sentence and summary.csv's eval columns, pure functions of the runs' records."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runs are only read here
    from distlab.report.report_run import ReportRun


def eval_sentence(runs: list[ReportRun]) -> str:
    """One line for a stage card: base -> trained eval loss of the stage's runs."""
    moved = []
    for run in runs:
        ev = run.section("eval") or {}
        trained, base = ev.get("trained") or {}, ev.get("base") or {}
        if trained.get("loss") is not None and base.get("loss") is not None:
            moved.append(f"{run.experiment} {base['loss']:.3f} -> {trained['loss']:.3f} "
                         f"({trained['tokens']} tokens)")
    masked = []
    for run in runs:
        tokens = ((run.section("data_prep") or {}).get("run_tokens")) or {}
        if tokens.get("masked"):
            masked.append(f"{run.experiment} trained on {tokens['trained']:,} response tokens, "
                          f"{tokens['masked']:,} prompt tokens masked")
    text = ("Fine-tuning moved held-out eval loss (base model -> trained, same tokens): " + "; ".join(moved) + "."
            if moved else "Held-out evaluation: no run of this stage recorded both a base and a trained eval loss.")
    return text + (" " + "; ".join(masked) + "." if masked else "")


def eval_columns(frame, runs: list[ReportRun]):
    """summary.csv's eval columns, matched to rows by machine and experiment."""
    by_key = {(r.machine, r.experiment): r.section("eval") or {} for r in runs}

    def pick(row, part, key):
        value = (by_key.get((row["machine"], row["experiment"]), {}).get(part) or {}).get(key)
        return value if isinstance(value, (int, float)) else None

    if frame.empty:
        return frame
    frame["eval_loss_base"] = frame.apply(lambda row: pick(row, "base", "loss"), axis=1)
    frame["eval_loss"] = frame.apply(lambda row: pick(row, "trained", "loss"), axis=1)
    frame["eval_perplexity"] = frame.apply(lambda row: pick(row, "trained", "perplexity"), axis=1)
    return frame
