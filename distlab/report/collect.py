"""Read every run (this machine's and other machines' folders) into one table.

A run is results/<machine>/<experiment>/: metrics.json, and when present steps.jsonl (per
step times), validation.json (checkpoint checks) and devices.json (GPU ids it held).
Machine-level files sit next to the runs: hardware.json, collectives.json. A run that is
corrupt, from another schema version or lacks a figure its status promises is named and
left out of the summary and the report (load_checked_runs), never a crash or a partial row.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from distlab.metrics import METRICS_SCHEMA_VERSION

VALIDATION_SCHEMA_VERSION = 1
COLLECTIVES_SCHEMA_VERSION = 1
HARDWARE_SCHEMA_VERSION = 1


class ResultsError(ValueError):
    """A results file that cannot be trusted (corrupt, or another schema version)."""


def read_json(path: Path, what: str, version: int | None) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: unreadable {what} file ({exc}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: {what} file is not a JSON object; fix or remove it")
    if version is not None and data.get("schema_version") != version:
        raise ResultsError(f"{path}: {what} schema_version {data.get('schema_version')!r}, this distlab reads "
                           f"{version}; refusing to mix it into the report")
    return data


def read_steps(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            float(row["step_time_s"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ResultsError(f"{path}: line {number} is not a step record ({exc}); fix or remove the file") \
                from None
        rows.append(row)
    return rows


def throughput_stats(run: dict) -> dict | None:
    """Tokens/s with a spread, as the report compares runs.

    repeats = R >= 2: the timed steps (after warm-up) are split into R consecutive windows;
    each window's tokens/s = tokens per step / its median step time; median over windows,
    spread = [min, max] over windows. R = 1: one window; spread = tokens per step over the
    75th and 25th percentile step time. Two runs whose spreads overlap have no clear winner.
    """
    tokens = (run.get("throughput") or {}).get("tokens_per_step")
    if not tokens:
        return None
    repeats = max(1, int(run["spec"].get("repeats", 1)))
    # "warmup": the row key before it was renamed "untimed" (results of older runs).
    timed = [r["step_time_s"] for r in run.get("_steps", []) if not r.get("untimed", r.get("warmup"))]
    if not timed:
        st = run["timing"]["step_time_s"]
        return {"median": tokens / st["median"], "low": tokens / st["p75"], "high": tokens / st["p25"],
                "windows": [], "repeats": 1,
                "how": "no steps.jsonl: spread = tokens/step over p75 and p25 step time from metrics.json"}
    if repeats == 1 or len(timed) < 2 * repeats:
        ordered = sorted(timed)
        q = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
        return {"median": tokens / statistics.median(ordered), "low": tokens / q[2], "high": tokens / q[0],
                "windows": [], "repeats": 1, "timed_steps": len(timed),
                "how": f"{len(timed)} timed steps; median tokens/s, spread from the step-time interquartile range"}
    size, extra = divmod(len(timed), repeats)
    windows, start = [], 0
    for k in range(repeats):
        end = start + size + (1 if k < extra else 0)
        windows.append(tokens / statistics.median(timed[start:end]))
        start = end
    return {"median": statistics.median(windows), "low": min(windows), "high": max(windows), "windows": windows,
            "repeats": repeats, "timed_steps": len(timed),
            "how": f"{len(timed)} timed steps in {repeats} windows; median and min-max of the windows' tokens/s"}


def clear_winner(a: dict, b: dict) -> bool:
    """True when the two runs' throughput spreads do not overlap."""
    sa, sb = a.get("_throughput"), b.get("_throughput")
    if not sa or not sb:
        return False
    return sa["low"] > sb["high"] or sb["low"] > sa["high"]


def load_run(path: str | Path) -> dict:
    path = Path(path)
    run = read_json(path, "metrics", METRICS_SCHEMA_VERSION)
    for key in ("experiment", "machine", "stage", "spec", "status"):
        if key not in run:
            raise ResultsError(f"{path}: metrics file lacks '{key}'; fix or remove it")
    if "actual" in run and "as_built" not in run:  # the name results written before 'as_built' used
        run["as_built"] = run.pop("actual")
    run["_path"] = str(path)
    run["_dir"] = str(path.parent)
    check_run(run)
    steps = path.parent / "steps.jsonl"
    run["_steps"] = read_steps(steps) if steps.is_file() else []
    validation = path.parent / "validation.json"
    run["_validation"] = read_json(validation, "validation", VALIDATION_SCHEMA_VERSION) \
        if validation.is_file() else None
    devices = path.parent / "devices.json"
    run["_devices"] = read_json(devices, "devices", None) if devices.is_file() else None
    run["_throughput"] = throughput_stats(run) if run["status"] == "ok" else None
    return run


# What a run of each status must hold before it enters the summary or the report: a result
# copied in from another machine (or truncated) is input like any other.
REQUIRED_FIELDS = {
    "ok": [("loss", "first"), ("loss", "last"), ("loss", "per_step"), ("throughput", "tokens_per_s"),
           ("throughput", "tokens_per_step"), ("timing", "step_time_s", "median")],
    "oom": [("oom",)],
}


def check_run(run: dict) -> None:
    """Refuse a run that lacks a figure its status promises (named, with the file)."""
    if run["status"] not in REQUIRED_FIELDS:
        raise ResultsError(f"{run['_path']}: status {run['status']!r} is none of {sorted(REQUIRED_FIELDS)}")
    for keys in REQUIRED_FIELDS[run["status"]]:
        value = _get(run, *keys)
        if value is None or (keys[-1] != "per_step" and keys[0] != "oom" and not _finite(value)):
            raise ResultsError(f"{run['_path']}: a run with status {run['status']!r} needs "
                               f"'{'.'.join(keys)}' (a number); it is {'missing' if value is None else repr(value)}")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf")


def load_checked_runs(paths) -> tuple[list[dict], list[dict]]:
    """(runs, rejected): every metrics.json that reads, has this schema version and the figures
    its status promises; each one that does not is left out as {"path", "reason"}."""
    runs, rejected = [], []
    for path in paths:
        try:
            run = load_run(path)
        except ResultsError as error:
            rejected.append({"path": str(path), "reason": str(error)})
            continue
        except (KeyError, TypeError, ValueError, AttributeError) as error:  # a field of the wrong shape
            rejected.append({"path": str(path), "reason": f"{path}: malformed metrics ({type(error).__name__}: "
                                                          f"{error})"})
            continue
        runs.append(run)
    check_unique(runs)
    return runs, rejected


def load_runs(paths) -> list[dict]:
    runs = [load_run(p) for p in paths]
    check_unique(runs)
    return runs


def check_unique(runs: list[dict]) -> None:
    seen = {}
    for run in runs:
        key = (run["machine"], run["experiment"])
        if key in seen:
            raise ResultsError(f"{run['_path']} and {seen[key]}: the same experiment of machine "
                               f"'{run['machine']}' twice; give one machine another tag (config `machine`) "
                               "so neither overwrites the other")
        seen[key] = run["_path"]


def machine_files(runs: list[dict], name: str, version: int) -> dict[str, dict]:
    """{machine: parsed <machine folder>/<name>} for every machine that has one."""
    out = {}
    for run in runs:
        path = Path(run["_dir"]).parent / name
        if run["machine"] not in out and path.is_file():
            out[run["machine"]] = read_json(path, name, version)
    return out


def _get(run, *keys, default=None):
    value = run
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def validation_status(run: dict) -> str | None:
    v = run.get("_validation")
    if v is None:
        return None
    return "passed" if v.get("passed") else "failed"


def summary_row(run: dict) -> dict:
    from distlab.memory import phase_peaks

    spec = run["spec"]
    step = _get(run, "timing", "step_time_s", default={}) or {}
    state0 = (_get(run, "memory", "model_state_bytes_per_rank", default=[]) or [{}])[0] or {}
    rss = [m.get("peak_rss_bytes", 0) for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [m.get("cuda_max_allocated_bytes") for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [v for v in cuda_peak if v is not None]
    spread = run.get("_throughput") or {}
    return {
        "machine": run["machine"], "stage": run["stage"], "experiment": run["experiment"],
        "status": run.get("status"), "strategy": spec["strategy"], "launcher": spec["launcher"],
        "method": spec["method"], "model": spec.get("model", "default"), "memory_budget_gib": spec.get("memory_budget_gib"),
        "device": spec["device"], "world_size": spec["world_size"],
        "micro_batch": spec["micro_batch"], "grad_accum": spec["grad_accum"], "seq_len": spec["seq_len"],
        "sampler": spec["sampler"], "precision": spec["precision"], "steps": spec["steps"],
        "untimed_steps": spec.get("untimed_steps", spec.get("warmup_steps")), "repeats": spec.get("repeats", 1),
        "actual_wrapper": _get(run, "as_built", "outer_wrapper"),
        "actual_world_size": _get(run, "as_built", "world_size"),
        "step_time_median_s": step.get("median"), "step_time_p25_s": step.get("p25"),
        "step_time_p75_s": step.get("p75"), "step_time_min_s": step.get("min"), "step_time_max_s": step.get("max"),
        "timed_steps": step.get("n"),
        "tokens_per_s": _get(run, "throughput", "tokens_per_s"),
        "tokens_per_s_low": spread.get("low"), "tokens_per_s_high": spread.get("high"),
        "tokens_per_s_per_rank": _get(run, "throughput", "tokens_per_s_per_rank"),
        "samples_per_s": _get(run, "throughput", "samples_per_s"),
        "mfu": _get(run, "flops", "mfu"),
        "comm_inflight_median_s": _get(run, "timing", "comm_inflight_s_per_step", "median"),
        "loss_first": _get(run, "loss", "first"), "loss_last": _get(run, "loss", "last"),
        "peak_rss_max_bytes": max(rss) if rss else None,
        # distlab.memory: process start -> first step, then the steps alone (largest rank).
        "load_phase_peak_max_bytes": phase_peaks(run)["load_phase"],
        "training_phase_peak_max_bytes": phase_peaks(run)["training_phase"],
        "cuda_max_allocated_max_bytes": max(cuda_peak) if cuda_peak else None,
        "state_params_bytes_rank0": state0.get("params"), "state_grads_bytes_rank0": state0.get("grads"),
        "state_optimizer_bytes_rank0": state0.get("optimizer"),
        "trainable_params": _get(run, "parameters", "trainable"), "total_params": _get(run, "parameters", "total"),
        "duplicate_fraction": _get(run, "data", "duplicate_fraction"),
        "checkpoint_validation": validation_status(run),
        "gpu_ids": ",".join(_get(run, "_devices", "cuda_visible_devices", default=[]) or []) or None,
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
