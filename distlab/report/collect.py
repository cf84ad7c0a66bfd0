"""Read every run (this machine's and other machines' folders) into one table.

A run is results/<machine>/<experiment>/: metrics.json, and when present steps.jsonl (per
step times), validation.json (checkpoint checks), devices.json (GPU ids it held) and
run_files/pipeline-rank<r>.json (pipeline records), benchmark.tsv (the train job's wall time) and
the text-to-image sample grid. Machine-level files sit next to the runs: hardware.json,
collectives.json, advice.json, advice-sd.json; kuberay/checks.json in the results folder. A rule
passes its declared inputs (`declared`): a file it did not declare is not read, so every file the
summary and the report read is an input of their rule (rules/common.smk). Every one of them is
checked against the JSON Schema of the fields the summary and the report read (results_schema.yaml: types, finite and
positive figures, name patterns), and `machine`/`experiment` must equal their folders' names
(a copied-in folder cannot file runs under another machine). A run whose files do not pass
is named and left out of the summary and the report (load_checked_runs), a machine file
likewise (machine_files), never a crash or a partial row.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import statistics
from pathlib import Path

from distlab.report.inputs import job_wall_seconds, readable
from distlab.records.run_layout import KUBERAY_CHECKS, run_files_dir
from distlab.records.run_outputs import (MAX_RESULTS_FILE_BYTES, ResultsError, parse_json, read_json_object,
                                         read_run_record, task_of, throughput_unit)

VALIDATION_SCHEMA_VERSION = 1
COLLECTIVES_SCHEMA_VERSION = 1
HARDWARE_SCHEMA_VERSION = 1


# The JSON Schema kind of each machine-level file.
MACHINE_FILE_KINDS = {"hardware.json": "hardware", "collectives.json": "collectives", "advice.json": "advice"}


def _schemas() -> dict:
    """results_schema.yaml with its enums filled from the axes' declarations (a strategy or task
    registered since the last call is in them)."""
    from distlab.configuration import axes

    return _filled_schemas(axes.frozen_names())


@functools.lru_cache(maxsize=4)
def _filled_schemas(names: tuple) -> dict:
    import yaml

    from distlab.configuration.axes import fill_enums

    return fill_enums(yaml.safe_load((Path(__file__).with_name("results_schema.yaml")).read_text()), dict(names))


def check_schema(data, kind: str, path) -> None:
    """Raise ResultsError naming the file and the first bad field when `data` does not match
    the schema of `kind` (results_schema.yaml)."""
    from jsonschema.exceptions import best_match

    from distlab.configuration.input_checks import StrictValidator

    schemas = _schemas()
    schema = {"$defs": schemas["$defs"], **schemas[kind]}
    errors = list(StrictValidator(schema).iter_errors(data))
    if errors:
        error = best_match(errors)
        where = [str(p) for p in error.absolute_path]
        if error.validator == "required":  # name the missing field itself
            missing = next((name for name in error.validator_value if name not in error.instance), None)
            where, message = where + [str(missing)], "missing"
        else:
            message = error.message[:300]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ResultsError(f"{path}: field '{'.'.join(where) or '(top level)'}': {message}{more}; "
                           "fix or remove the file")


def read_json(path: Path, what: str, version: int | None, kind: str | None = None) -> dict:
    """A results file as a dict: readable, a JSON object, of this schema version and (kind)
    matching its JSON Schema."""
    data = read_json_object(path, what, version)
    if kind is not None:
        check_schema(data, kind, path)
    return data


def read_steps(path: Path) -> list[dict]:
    if path.stat().st_size > MAX_RESULTS_FILE_BYTES:
        raise ResultsError(f"{path}: larger than {MAX_RESULTS_FILE_BYTES >> 20} MB, which no steps file is")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, path, f"line {number}")
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{path}: line {number} is not a step record ({exc}); fix or remove the file") \
                from None
        check_schema(row, "step", f"{path}: line {number}")
        rows.append(row)
    return rows


def unit_of(run: dict) -> str:
    """What a run's throughput counts (distlab.records.run_outputs.throughput_unit): tokens (causal
    LM, and runs written before tasks existed) or images (text-to-image)."""
    return throughput_unit(run)


def throughput_stats(run: dict) -> dict | None:
    """Tokens/s (images/s for a text-to-image run) with a spread, as the report compares runs.

    launches = L >= 2 (separate launches, distlab.jobs.launches): median and min-max over them.
    Else repeats = R >= 2: the timed steps (after warm-up) are split into R consecutive windows;
    each window's tokens/s = tokens per step / its median step time; median over windows,
    spread = [min, max] over windows. R = 1: one window; spread = tokens per step over the
    75th and 25th percentile step time. Two runs whose spreads overlap have no clear winner.
    """
    unit = unit_of(run)
    tokens = (run.get("throughput") or {}).get(f"{unit}s_per_step")
    if not tokens:
        return None
    per_launch = run.get("launches") or []
    if any(throughput_unit(x) != unit for x in per_launch):
        raise ResultsError(f"{run.get('_path', 'metrics.json')}: field 'launches' counts in another unit than the "
                           f"run's {unit}s; fix or remove the file")
    launches = [x[f"{unit}s_per_s"] for x in per_launch]
    if len(launches) >= 2:  # spec launches: independent launches, the run-to-run spread
        return {"median": statistics.median(launches), "low": min(launches), "high": max(launches),
                "windows": launches, "repeats": 1, "launches": len(launches),
                "timed_steps": run["timing"]["step_time_s"]["n"],
                "how": f"{len(launches)} independent launches; median and min-max of their {unit}s/s"}
    repeats = max(1, int(run["spec"].get("repeats", 1)))
    # "warmup": the row key before it was renamed "untimed" (results of older runs).
    timed = [r["step_time_s"] for r in run.get("_steps", []) if not r.get("untimed", r.get("warmup"))]
    if not timed:
        st = run["timing"]["step_time_s"]
        return {"median": tokens / st["median"], "low": tokens / st["p75"], "high": tokens / st["p25"],
                "windows": [], "repeats": 1,
                "how": f"no steps.jsonl: spread = {unit}s/step over p75 and p25 step time from metrics.json"}
    if repeats == 1 or len(timed) < 2 * repeats:
        ordered = sorted(timed)
        q = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
        return {"median": tokens / statistics.median(ordered), "low": tokens / q[2], "high": tokens / q[0],
                "windows": [], "repeats": 1, "timed_steps": len(timed),
                "how": f"{len(timed)} timed steps; median {unit}s/s, spread from the step-time interquartile range"}
    size, extra = divmod(len(timed), repeats)
    windows, start = [], 0
    for k in range(repeats):
        end = start + size + (1 if k < extra else 0)
        windows.append(tokens / statistics.median(timed[start:end]))
        start = end
    return {"median": statistics.median(windows), "low": min(windows), "high": max(windows), "windows": windows,
            "repeats": repeats, "timed_steps": len(timed),
            "how": f"{len(timed)} timed steps in {repeats} windows; median and min-max of the windows' {unit}s/s"}


def clear_winner(a: dict, b: dict) -> bool:
    """True when the two runs' throughput spreads do not overlap."""
    sa, sb = a.get("_throughput"), b.get("_throughput")
    if not sa or not sb:
        return False
    return sa["low"] > sb["high"] or sb["low"] > sa["high"]


def load_run(path: str | Path, named_folder: bool = True, declared: frozenset[str] | None = None) -> dict:
    """One metrics.json with what beside it the summary and the report read (only the files in
    `declared`, when given): cards read these fields and open no file. named_folder: the run sits
    in <machine>/<experiment>/ (False: the two_hosts target's own fixed folder, still its machine's)."""
    path = Path(path)
    record = read_run_record(path)  # the one reader of metrics.json
    # The report's run table: the file as a dict (cards add what lies beside it), its spec typed.
    run = record.to_dict()
    check_schema(run, "metrics", path)
    folders = (("machine", path.parent.parent.name), ("experiment", path.parent.name))
    for field, folder in folders if named_folder else folders[:1]:
        if run[field] != folder:
            raise ResultsError(f"{path}: field '{field}' is {run[field]!r} but the file sits in folder {folder!r}; "
                               f"a run is filed under its own {field}: fix or remove it")
    run["_path"] = str(path)
    run["_dir"] = str(path.parent)
    steps = path.parent / "steps.jsonl"
    run["_steps"] = read_steps(steps) if readable(steps, declared) else []
    validation = path.parent / "validation.json"
    run["_validation"] = read_json(validation, "validation", VALIDATION_SCHEMA_VERSION, "validation") \
        if readable(validation, declared) else None
    devices = path.parent / "devices.json"
    run["_devices"] = read_json(devices, "devices", None, "devices") if readable(devices, declared) else None
    run["_pipeline_records"] = [read_json(record, "pipeline record", None, "pipeline_record")  # the parallel card's
                                for record in sorted(run_files_dir(path.parent).glob("pipeline-rank*.json"))
                                if readable(record, declared)]
    wall = path.parent / "benchmark.tsv"
    run["_job_wall_s"] = job_wall_seconds(wall) if readable(wall, declared) else None
    samples = ((run.get("eval") or {}).get("trained") or {}).get("samples") or {}
    grid = path.parent / samples.get("path", "run_files/samples.png")  # the text-to-image card shows it
    run["_samples_png"] = grid.read_bytes() if samples and readable(grid, declared) else None
    run["_throughput"] = throughput_stats(run) if run["status"] == "ok" else None
    return run


def shared_metrics_paths(roots, mine: str) -> tuple[list[str], list[dict]]:
    """(paths, ignored): metrics.json of every machine folder under `roots` but this machine's
    own (`mine`, <results>/<machine>), and those ignored as {"path", "reason"}: a path holding
    '{' or '}' (a folder like results/{x}/ copied in by mistake) cannot be a rule's input, as
    Snakemake reads it as a wildcard and stops every call with an error that names no folder."""
    found = []
    for root in roots:
        found += glob.glob(os.path.join(glob.escape(root), "*", "*", "metrics.json"))
    mine = os.path.normpath(mine)
    paths, ignored = [], []
    for path in sorted(f for f in found if not os.path.normpath(f).startswith(mine + os.sep)):
        if "{" in path or "}" in path:
            ignored.append({"path": path, "reason": f"{path}: ignored: a folder name with '{{' or '}}' cannot be "
                                                    "read by the workflow (Snakemake takes it for a wildcard); "
                                                    "rename or remove the folder"})
        else:
            paths.append(path)
    return paths, ignored


def load_checked_runs(paths, named_folder: bool = True, declared: frozenset[str] | None = None) \
        -> tuple[list[dict], list[dict]]:
    """(runs, rejected): every metrics.json that reads, has this schema version, matches the
    schema (so holds the figures its status promises) and is the only one of its machine and
    experiment; each one that does not is left out as {"path", "reason"}."""
    runs, rejected, seen = [], [], {}
    for path in paths:
        try:
            run = load_run(path, named_folder, declared)
            key = (run["machine"], run["experiment"])
            if key in seen:
                raise ResultsError(f"{path}: the same experiment of machine '{run['machine']}' as {seen[key]}; "
                                   "give one machine another tag (config `machine`)")
        except ResultsError as error:
            rejected.append({"path": str(path), "reason": str(error)})
            continue
        seen[key] = str(path)
        runs.append(run)
    return runs, rejected


def load_runs(paths, declared: frozenset[str] | None = None) -> list[dict]:
    runs = [load_run(p, declared=declared) for p in paths]
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


def machine_files(runs: list[dict], name: str, version: int | None, rejected: list | None = None,
                  declared: frozenset[str] | None = None) -> dict[str, dict]:
    """{machine: parsed <machine folder>/<name>} for every machine that has one that passes
    its schema (with the machine it names equal to its folder's); the others are named in
    `rejected` ({"path", "reason"}) and left out."""
    out, tried = {}, set()
    for run in runs:
        path = Path(run["_dir"]).parent / name
        if run["machine"] in tried or not readable(path, declared):
            continue
        tried.add(run["machine"])
        try:
            data = read_json(path, name, version, MACHINE_FILE_KINDS.get(name))
            if "machine" in data and data["machine"] != run["machine"]:
                raise ResultsError(f"{path}: field 'machine' is {data['machine']!r} but the file sits in folder "
                                   f"{run['machine']!r}; fix or remove it")
        except ResultsError as error:
            if rejected is not None:
                rejected.append({"path": str(path), "reason": str(error)})
            continue
        out[run["machine"]] = data
    return out


def attach_machine_records(runs: list[dict], rejected: list | None = None,
                           declared: frozenset[str] | None = None) -> None:
    """What a card reads beyond a run's own folder, read once per file and handed over on the run:
    `_sd_advice` (its machine's advice-sd.json, rule advise_sd) and `_kuberay` ((path, record) of
    its results folder's kuberay/checks.json, rule kuberay); None when absent or refused."""
    sd_advice = machine_files(runs, "advice-sd.json", None, rejected, declared)
    checks: dict[Path, tuple | None] = {}
    for run in runs:
        run["_sd_advice"] = sd_advice.get(run["machine"])
        path = Path(run["_dir"]).parent.parent / KUBERAY_CHECKS
        if path not in checks:
            checks[path] = None
            if readable(path, declared):
                try:
                    checks[path] = (path, read_json(path, "kuberay checks", 1, "kuberay_checks"))
                except ResultsError:  # the card says the checks were not run
                    pass
        run["_kuberay"] = checks[path]


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


def throughput_columns(run: dict, spread: dict) -> dict:
    """The run's unit and, for every unit a task counts in (distlab.configuration.axes), its
    <unit>s_per_s with the spread the report compares (low, high) and per rank: filled in the
    run's own unit, empty in the others."""
    from distlab.configuration.axes import names

    unit = unit_of(run)
    columns = {"unit": unit}
    for each in names()["units"]:
        mine = each == unit
        columns.update({f"{each}s_per_s": _get(run, "throughput", f"{each}s_per_s") if mine else None,
                        f"{each}s_per_s_low": spread.get("low") if mine else None,
                        f"{each}s_per_s_high": spread.get("high") if mine else None,
                        f"{each}s_per_s_per_rank": _get(run, "throughput", f"{each}s_per_s_per_rank") if mine
                        else None})
    return columns


def summary_row(run: dict) -> dict:
    from distlab.records.memory_phases import phase_peaks

    spec = run["spec"]
    step = _get(run, "timing", "step_time_s", default={}) or {}
    state0 = (_get(run, "memory", "model_state_bytes_per_rank", default=[]) or [{}])[0] or {}
    rss = [m.get("peak_rss_bytes", 0) for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [m.get("cuda_max_allocated_bytes") for m in _get(run, "memory", "per_rank", default=[]) or []]
    cuda_peak = [v for v in cuda_peak if v is not None]
    spread = run.get("_throughput") or {}
    return {
        "machine": run["machine"], "stage": run["stage"], "task": task_of(spec),
        "experiment": run["experiment"],
        "status": run.get("status"), "strategy": spec.strategy,
        # Its own settings block (`deepspeed: {zero_stage, ...}`), whatever the strategy: read by name.
        "strategy_settings": json.dumps(spec[spec.strategy], sort_keys=True) if spec.get(spec.strategy) else None,
        "launcher": spec.launcher,
        "method": spec.method, "model": spec.model,
        "memory_budget_gib": spec.memory_budget_gib,
        "device": spec.device, "world_size": spec.world_size,
        "micro_batch": spec.micro_batch, "grad_accum": spec.grad_accum, "seq_len": spec.seq_len,
        "sampler": spec.sampler, "precision": spec.precision, "steps": spec.steps,
        "untimed_steps": spec.get("untimed_steps", spec.warmup_steps), "repeats": spec.repeats,
        "actual_wrapper": _get(run, "as_built", "outer_wrapper"),
        "actual_world_size": _get(run, "as_built", "world_size"),
        "step_time_median_s": step.get("median"), "step_time_p25_s": step.get("p25"),
        "step_time_p75_s": step.get("p75"), "step_time_min_s": step.get("min"), "step_time_max_s": step.get("max"),
        "timed_steps": step.get("n"),
        **throughput_columns(run, spread),
        "samples_per_s": _get(run, "throughput", "samples_per_s"),
        "mfu": _get(run, "flops", "mfu"),
        "comm_inflight_median_s": _get(run, "timing", "comm_inflight_s_per_step", "median"),
        # distlab.runtime.noise: other processes' CPU while the steps were timed; busy = figures inflated.
        "machine_busy": _get(run, "noise", "busy"), "others_cores": _get(run, "noise", "others_cores"),
        "load_avg_1min_max": max(_get(run, "noise", "load_avg_1min", default=None) or [None], key=lambda v: v or 0),
        "loss_first": _get(run, "loss", "first"), "loss_last": _get(run, "loss", "last"),
        "peak_rss_max_bytes": max(rss) if rss else None,
        # distlab.runtime.memory: process start -> first step, then the steps alone (largest rank).
        "load_phase_peak_max_bytes": phase_peaks(run)["load_phase"],
        "training_phase_peak_max_bytes": phase_peaks(run)["training_phase"],
        "save_phase_peak_max_bytes": phase_peaks(run)["save_phase"],
        "cuda_max_allocated_max_bytes": max(cuda_peak) if cuda_peak else None,
        "state_params_bytes_rank0": state0.get("params"), "state_grads_bytes_rank0": state0.get("grads"),
        "state_optimizer_bytes_rank0": state0.get("optimizer"),
        "trainable_params": _get(run, "parameters", "trainable"), "total_params": _get(run, "parameters", "total"),
        "duplicate_fraction": _get(run, "data", "duplicate_fraction"),
        # saved, failed (trained, its figures stand, no checkpoint: error in metrics.json), unsupported, off
        "checkpoint": _get(run, "checkpoint", "status"),
        "checkpoint_bytes": _get(run, "checkpoint", "bytes"),
        "checkpoint_validation": validation_status(run),
        "gpu_ids": ",".join(_get(run, "_devices", "cuda_visible_devices", default=[]) or []) or None,
        "torch": _get(run, "versions", "torch"),
        "path": run["_dir"],
    }


def summary_frame(runs: list[dict]):
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
