"""summary.csv: one row per run (rule summary, scripts/summary.py), read from the typed runs
collect.load_checked_runs returns (distlab.report.report_run.ReportRun)."""
from __future__ import annotations

import json

from distlab.records.run_outputs import task_of
from distlab.report.report_run import ReportRun, ThroughputSpread


def _get(mapping, *keys, default=None):
    """The value at keys inside nested mappings (a run's sections), default where one is absent."""
    value = mapping
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return default
        value = value[key]
    return value


def validation_status(run: ReportRun) -> str | None:
    if run.validation is None:
        return None
    return "passed" if run.validation.get("passed") else "failed"


def throughput_columns(run: ReportRun, spread: ThroughputSpread | None) -> dict:
    """The run's unit and, for every unit a task counts in (distlab.configuration.axes), its
    <unit>s_per_s with the spread the report compares (low, high) and per rank: filled in the
    run's own unit, empty in the others."""
    from distlab.configuration.axes import names

    unit = run.unit
    columns = {"unit": unit}
    for each in names()["units"]:
        mine = each == unit
        columns.update({f"{each}s_per_s": _get(run.throughput, f"{each}s_per_s") if mine else None,
                        f"{each}s_per_s_low": spread.low if mine and spread else None,
                        f"{each}s_per_s_high": spread.high if mine and spread else None,
                        f"{each}s_per_s_per_rank": _get(run.throughput, f"{each}s_per_s_per_rank") if mine
                        else None})
    return columns


def summary_row(run: ReportRun) -> dict:
    from distlab.records.memory_phases import phase_peaks

    spec = run.spec
    step = _get(run.timing, "step_time_s", default={}) or {}
    state0 = (_get(run.memory, "model_state_bytes_per_rank", default=[]) or [{}])[0] or {}
    rss = [m.get("peak_rss_bytes", 0) for m in _get(run.memory, "per_rank", default=[]) or []]
    cuda_peak = [m.get("cuda_max_allocated_bytes") for m in _get(run.memory, "per_rank", default=[]) or []]
    cuda_peak = [v for v in cuda_peak if v is not None]
    peaks = phase_peaks(run.metrics)
    settings = spec.block(spec.strategy)
    return {
        "machine": run.machine, "stage": run.stage, "task": task_of(spec),
        "experiment": run.experiment,
        "status": run.status, "strategy": spec.strategy,
        # Its own settings block (`deepspeed: {zero_stage, ...}`), whatever the strategy: read by name.
        "strategy_settings": json.dumps(settings, sort_keys=True) if settings else None,
        "launcher": spec.launcher,
        "method": spec.method, "model": spec.model,
        "memory_budget_gib": spec.memory_budget_gib,
        "device": spec.device, "world_size": spec.world_size,
        "micro_batch": spec.micro_batch, "grad_accum": spec.grad_accum, "seq_len": spec.seq_len,
        "sampler": spec.sampler, "precision": spec.precision, "steps": spec.steps,
        "untimed_steps": spec.get("untimed_steps", spec.warmup_steps), "repeats": spec.repeats,
        "actual_wrapper": _get(run.as_built, "outer_wrapper"),
        "actual_world_size": _get(run.as_built, "world_size"),
        "step_time_median_s": step.get("median"), "step_time_p25_s": step.get("p25"),
        "step_time_p75_s": step.get("p75"), "step_time_min_s": step.get("min"), "step_time_max_s": step.get("max"),
        "timed_steps": step.get("n"),
        **throughput_columns(run, run.throughput_spread),
        "samples_per_s": _get(run.throughput, "samples_per_s"),
        "mfu": _get(run.section("flops"), "mfu"),
        "comm_inflight_median_s": _get(run.timing, "comm_inflight_s_per_step", "median"),
        # distlab.runtime.noise: other processes' CPU while the steps were timed; busy = figures inflated.
        "machine_busy": _get(run.noise, "busy"), "others_cores": _get(run.noise, "others_cores"),
        "load_avg_1min_max": max(_get(run.noise, "load_avg_1min", default=None) or [None], key=lambda v: v or 0),
        "loss_first": _get(run.loss, "first"), "loss_last": _get(run.loss, "last"),
        "peak_rss_max_bytes": max(rss) if rss else None,
        # distlab.runtime.memory: process start -> first step, then the steps alone (largest rank).
        "load_phase_peak_max_bytes": peaks["load_phase"],
        "training_phase_peak_max_bytes": peaks["training_phase"],
        "save_phase_peak_max_bytes": peaks["save_phase"],
        "cuda_max_allocated_max_bytes": max(cuda_peak) if cuda_peak else None,
        "state_params_bytes_rank0": state0.get("params"), "state_grads_bytes_rank0": state0.get("grads"),
        "state_optimizer_bytes_rank0": state0.get("optimizer"),
        "trainable_params": _get(run.section("parameters"), "trainable"),
        "total_params": _get(run.section("parameters"), "total"),
        "duplicate_fraction": _get(run.section("data"), "duplicate_fraction"),
        # saved, failed (trained, its figures stand, no checkpoint: error in metrics.json), unsupported, off
        "checkpoint": _get(run.section("checkpoint"), "status"),
        "checkpoint_bytes": _get(run.section("checkpoint"), "bytes"),
        "checkpoint_validation": validation_status(run),
        "gpu_ids": ",".join(_get(run.devices, "cuda_visible_devices", default=[]) or []) or None,
        "torch": _get(run.section("versions"), "torch"),
        "path": run.folder,
    }


def summary_frame(runs: list[ReportRun]):
    import pandas as pd

    from distlab.configuration.axes import STAGE_ORDER

    frame = pd.DataFrame([summary_row(r) for r in runs])
    if frame.empty:
        return frame
    frame["_stage_order"] = frame["stage"].map({s: i for i, s in enumerate(STAGE_ORDER)})
    frame = frame.sort_values(["_stage_order", "machine", "experiment"]).drop(columns="_stage_order")
    return frame.reset_index(drop=True)


# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...), DDE):
# such a text cell of summary.csv gets a leading apostrophe, as OWASP's CSV-injection advice says.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(frame):
    """The frame with every text cell that a spreadsheet would run as a formula neutralised."""
    def safe(value):
        return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value

    return frame.map(safe)
