"""A run's two result files: metrics.json (strict JSON) and steps.jsonl."""
from __future__ import annotations

import json
import os
from pathlib import Path

from distlab.sharing import portable


def nan_to_none(value):
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return value


def write_outputs(run_dir: str, summary) -> None:
    """Rank 0 (or the Ray driver): summary = (metrics, step rows) -> metrics.json, steps.jsonl."""
    metrics, steps = summary
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "steps.jsonl", "w") as fh:
        for row in steps:
            fh.write(json.dumps(row) + "\n")
    write_metrics(run, metrics)


def write_metrics(run_dir, metrics: dict) -> None:
    """The one writer of a run's metrics.json (rank 0, the Ray driver, launch's oom record).
    Strict JSON (no NaN): a figure that was not measured is null, with its reason beside it.
    Paths of the checkout and home folder relative (distlab.sharing): the file is shared.
    Written beside and renamed over the old one, so a reader never sees half a file."""
    metrics = portable(json.loads(json.dumps(nan_to_none(metrics), default=str)))
    path = Path(run_dir) / "metrics.json"
    partial = path.with_name("metrics.json.partial")
    partial.write_text(json.dumps(metrics, indent=1))
    os.replace(partial, path)


def one_line(metrics: dict) -> str:
    """A finished run in one line, for the terminal Snakemake runs the job in."""
    if metrics.get("status") != "ok":
        return f"{metrics['experiment']}: {metrics.get('status')}"
    loss, timing = metrics["loss"], metrics["timing"]["step_time_s"]
    unit = metrics["throughput"].get("unit", "token")  # the task's: tokens or images
    trained = (metrics.get("eval") or {}).get("trained") or {}
    held_out = f", eval loss {trained['loss']:.3f}" if isinstance(trained.get("loss"), float) else ""
    return (f"{metrics['experiment']}: ok, {len(loss['per_step'])} steps, loss {loss['first']:.3f} -> "
            f"{loss['last']:.3f}{held_out}, {metrics['throughput'][f'{unit}s_per_s']:,.0f} {unit}s/s "
            f"(median step {timing['median'] * 1000:.0f} ms), {metrics['wall_seconds_rank0']:.0f} s")
