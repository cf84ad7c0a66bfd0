"""Read every run's metrics.json (this machine's and shared ones) into one table."""
from __future__ import annotations

import json
from pathlib import Path

from distlab.metrics import METRICS_SCHEMA_VERSION


class ResultsError(ValueError):
    """A results file that cannot be trusted (corrupt, or another schema version)."""


def load_run(path: str | Path) -> dict:
    path = Path(path)
    try:
        run = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: unreadable metrics file ({exc})") from None
    if not isinstance(run, dict) or run.get("schema_version") != METRICS_SCHEMA_VERSION:
        found = run.get("schema_version") if isinstance(run, dict) else None
        raise ResultsError(f"{path}: metrics schema_version {found!r}, this distlab reads "
                           f"{METRICS_SCHEMA_VERSION}; refusing to mix it into the report")
    run["_path"] = str(path)
    run["_dir"] = str(path.parent)
    return run


def load_runs(paths) -> list[dict]:
    runs = [load_run(p) for p in paths]
    seen = {}
    for run in runs:
        key = (run["machine"], run["experiment"])
        if key in seen:
            raise ResultsError(f"{run['_path']} and {seen[key]}: the same experiment of machine "
                               f"'{run['machine']}' twice; rename one machine folder")
        seen[key] = run["_path"]
    return runs


def _get(run, *keys, default=None):
    value = run
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def summary_row(run: dict) -> dict:
    spec = run["spec"]
    step = _get(run, "timing", "step_time_s", default={}) or {}
    state0 = (_get(run, "memory", "model_state_bytes_per_rank", default=[]) or [{}])[0] or {}
    rss = [m.get("peak_rss_bytes", 0) for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [m.get("cuda_max_allocated_bytes") for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [v for v in cuda_peak if v is not None]
    return {
        "machine": run["machine"], "stage": run["stage"], "experiment": run["experiment"],
        "status": run.get("status"), "strategy": spec["strategy"], "launcher": spec["launcher"],
        "method": spec["method"], "device": spec["device"], "world_size": spec["world_size"],
        "micro_batch": spec["micro_batch"], "grad_accum": spec["grad_accum"], "seq_len": spec["seq_len"],
        "sampler": spec["sampler"], "precision": spec["precision"], "steps": spec["steps"],
        "warmup_steps": spec["warmup_steps"],
        "actual_wrapper": _get(run, "actual", "outer_wrapper"),
        "actual_world_size": _get(run, "actual", "world_size"),
        "step_time_median_s": step.get("median"), "step_time_p25_s": step.get("p25"),
        "step_time_p75_s": step.get("p75"), "step_time_min_s": step.get("min"), "step_time_max_s": step.get("max"),
        "timed_steps": step.get("n"),
        "tokens_per_s": _get(run, "throughput", "tokens_per_s"),
        "tokens_per_s_per_rank": _get(run, "throughput", "tokens_per_s_per_rank"),
        "samples_per_s": _get(run, "throughput", "samples_per_s"),
        "mfu": _get(run, "flops", "mfu"),
        "comm_inflight_median_s": _get(run, "timing", "comm_inflight_s_per_step", "median"),
        "loss_first": _get(run, "loss", "first"), "loss_last": _get(run, "loss", "last"),
        "peak_rss_max_bytes": max(rss) if rss else None,
        "cuda_max_allocated_max_bytes": max(cuda_peak) if cuda_peak else None,
        "state_params_bytes_rank0": state0.get("params"), "state_grads_bytes_rank0": state0.get("grads"),
        "state_optimizer_bytes_rank0": state0.get("optimizer"),
        "trainable_params": _get(run, "parameters", "trainable"), "total_params": _get(run, "parameters", "total"),
        "duplicate_fraction": _get(run, "data", "duplicate_fraction"),
        "torch": _get(run, "versions", "torch"),
        "path": run["_dir"],
    }


def summary_frame(runs: list[dict]):
    import pandas as pd

    from distlab.config import STAGE_ORDER

    frame = pd.DataFrame([summary_row(r) for r in runs])
    if frame.empty:
        return frame
    frame["_stage_order"] = frame["stage"].map({s: i for i, s in enumerate(STAGE_ORDER)})
    frame = frame.sort_values(["_stage_order", "machine", "experiment"]).drop(columns="_stage_order")
    return frame.reset_index(drop=True)
