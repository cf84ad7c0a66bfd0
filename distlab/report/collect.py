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
from dataclasses import replace
from pathlib import Path

from distlab.report.inputs import job_wall_seconds, readable
from distlab.records.run_layout import KUBERAY_CHECKS, run_files_dir
from distlab.records.run_outputs import (MAX_RESULTS_FILE_BYTES, ResultsError, RunRecord, parse_json,
                                         read_json_object, read_run_record, throughput_unit)
from distlab.records.spec import freeze, thaw
from distlab.report.report_run import ReportRun, ThroughputSpread

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


def throughput_stats(record: RunRecord, steps=()) -> ThroughputSpread | None:
    """Tokens/s (images/s for a text-to-image run) with a spread, as the report compares runs;
    steps: the run's steps.jsonl rows (none read: the spread comes from metrics.json's step times).

    launches = L >= 2 (separate launches, distlab.jobs.launches): median and min-max over them.
    Else repeats = R >= 2: the timed steps (after warm-up) are split into R consecutive windows;
    each window's tokens/s = tokens per step / its median step time; median over windows,
    spread = [min, max] over windows. R = 1: one window; spread = tokens per step over the
    75th and 25th percentile step time. Two runs whose spreads overlap have no clear winner.
    """
    unit = record.unit
    tokens = (record.throughput or {}).get(f"{unit}s_per_step")
    if not tokens:
        return None
    per_launch = record.data.get("launches") or []
    if any(throughput_unit(x) != unit for x in per_launch):
        raise ResultsError(f"{record.path}: field 'launches' counts in another unit than the "
                           f"run's {unit}s; fix or remove the file")
    launches = tuple(x[f"{unit}s_per_s"] for x in per_launch)
    if len(launches) >= 2:  # spec launches: independent launches, the run-to-run spread
        return ThroughputSpread(statistics.median(launches), min(launches), max(launches), windows=launches,
                                repeats=1, launches=len(launches), timed_steps=record.timing.step_time_s.n,
                                how=f"{len(launches)} independent launches; median and min-max of their {unit}s/s")
    repeats = max(1, int(record.spec.repeats))
    # "warmup": the row key before it was renamed "untimed" (results of older runs).
    timed = [r["step_time_s"] for r in steps if not r.get("untimed", r.get("warmup"))]
    if not timed:
        st = record.timing.step_time_s
        return ThroughputSpread(tokens / st.median, tokens / st.p75, tokens / st.p25, windows=(), repeats=1,
                                how=f"no steps.jsonl: spread = {unit}s/step over p75 and p25 step time from "
                                    "metrics.json")
    if repeats == 1 or len(timed) < 2 * repeats:
        ordered = sorted(timed)
        q = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
        return ThroughputSpread(tokens / statistics.median(ordered), tokens / q[2], tokens / q[0], windows=(),
                                repeats=1, timed_steps=len(timed),
                                how=f"{len(timed)} timed steps; median {unit}s/s, spread from the step-time "
                                    "interquartile range")
    size, extra = divmod(len(timed), repeats)
    windows, start = [], 0
    for k in range(repeats):
        end = start + size + (1 if k < extra else 0)
        windows.append(tokens / statistics.median(timed[start:end]))
        start = end
    return ThroughputSpread(statistics.median(windows), min(windows), max(windows), windows=tuple(windows),
                            repeats=repeats, timed_steps=len(timed),
                            how=f"{len(timed)} timed steps in {repeats} windows; median and min-max of the "
                                f"windows' {unit}s/s")


def clear_winner(a: ReportRun, b: ReportRun) -> bool:
    """True when the two runs' throughput spreads do not overlap."""
    sa, sb = a.throughput_spread, b.throughput_spread
    if not sa or not sb:
        return False
    return sa.low > sb.high or sb.low > sa.high


def load_run(path: str | Path, named_folder: bool = True, declared: frozenset[str] | None = None) -> ReportRun:
    """One metrics.json with what beside it the summary and the report read (only the files in
    `declared`, when given): cards read these fields and open no file. named_folder: the run sits
    in <machine>/<experiment>/ (False: the two_hosts target's own fixed folder, still its machine's)."""
    path = Path(path)
    record = read_run_record(path)  # the one reader of metrics.json
    check_schema(thaw(record.data), "metrics", path)  # the file's own fields, as written
    folders = (("machine", path.parent.parent.name), ("experiment", path.parent.name))
    for field, folder in folders if named_folder else folders[:1]:
        if getattr(record, field) != folder:
            raise ResultsError(f"{path}: field '{field}' is {getattr(record, field)!r} but the file sits in folder "
                               f"{folder!r}; a run is filed under its own {field}: fix or remove it")
    beside = path.parent
    steps = tuple(freeze(row) for row in read_steps(beside / "steps.jsonl")) \
        if readable(beside / "steps.jsonl", declared) else ()
    validation = beside / "validation.json"
    devices = beside / "devices.json"
    wall = beside / "benchmark.tsv"
    samples = ((record.data.get("eval") or {}).get("trained") or {}).get("samples") or {}
    grid = beside / samples.get("path", "run_files/samples.png")  # the text-to-image card shows it
    return ReportRun(
        record, path=str(path), folder=str(beside), steps=steps,
        validation=freeze(read_json(validation, "validation", VALIDATION_SCHEMA_VERSION, "validation"))
        if readable(validation, declared) else None,
        devices=freeze(read_json(devices, "devices", None, "devices")) if readable(devices, declared) else None,
        pipeline_records=tuple(freeze(read_json(each, "pipeline record", None, "pipeline_record"))
                               for each in sorted(run_files_dir(beside).glob("pipeline-rank*.json"))
                               if readable(each, declared)),
        job_wall_s=job_wall_seconds(wall) if readable(wall, declared) else None,
        samples_png=grid.read_bytes() if samples and readable(grid, declared) else None,
        throughput_spread=throughput_stats(record, steps) if record.status == "ok" else None)


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
        -> tuple[list[ReportRun], list[dict]]:
    """(runs, rejected): every metrics.json that reads, has this schema version, matches the
    schema (so holds the figures its status promises) and is the only one of its machine and
    experiment; each one that does not is left out as {"path", "reason"}."""
    runs, rejected, seen = [], [], {}
    for path in paths:
        try:
            run = load_run(path, named_folder, declared)
            key = (run.machine, run.experiment)
            if key in seen:
                raise ResultsError(f"{path}: the same experiment of machine '{run.machine}' as {seen[key]}; "
                                   "give one machine another tag (config `machine`)")
        except ResultsError as error:
            rejected.append({"path": str(path), "reason": str(error)})
            continue
        seen[key] = str(path)
        runs.append(run)
    return runs, rejected


def load_runs(paths, declared: frozenset[str] | None = None) -> list[ReportRun]:
    runs = [load_run(p, declared=declared) for p in paths]
    check_unique(runs)
    return runs


def check_unique(runs: list[ReportRun]) -> None:
    seen = {}
    for run in runs:
        key = (run.machine, run.experiment)
        if key in seen:
            raise ResultsError(f"{run.path} and {seen[key]}: the same experiment of machine "
                               f"'{run.machine}' twice; give one machine another tag (config `machine`) "
                               "so neither overwrites the other")
        seen[key] = run.path


def machine_files(runs: list[ReportRun], name: str, version: int | None, rejected: list | None = None,
                  declared: frozenset[str] | None = None) -> dict[str, dict]:
    """{machine: parsed <machine folder>/<name>} for every machine that has one that passes
    its schema (with the machine it names equal to its folder's); the others are named in
    `rejected` ({"path", "reason"}) and left out."""
    out, tried = {}, set()
    for run in runs:
        path = Path(run.folder).parent / name
        if run.machine in tried or not readable(path, declared):
            continue
        tried.add(run.machine)
        try:
            data = read_json(path, name, version, MACHINE_FILE_KINDS.get(name))
            if "machine" in data and data["machine"] != run.machine:
                raise ResultsError(f"{path}: field 'machine' is {data['machine']!r} but the file sits in folder "
                                   f"{run.machine!r}; fix or remove it")
        except ResultsError as error:
            if rejected is not None:
                rejected.append({"path": str(path), "reason": str(error)})
            continue
        out[run.machine] = data
    return out


def attach_machine_records(runs: list[ReportRun], rejected: list | None = None,
                           declared: frozenset[str] | None = None) -> list[ReportRun]:
    """The runs with what a card reads beyond a run's own folder, read once per file: `sd_advice`
    (its machine's advice-sd.json, rule advise_sd) and `kuberay` ((path, record) of its results
    folder's kuberay/checks.json, rule kuberay); None when absent or refused."""
    sd_advice = machine_files(runs, "advice-sd.json", None, rejected, declared)
    checks: dict[Path, tuple | None] = {}
    attached = []
    for run in runs:
        path = Path(run.folder).parent.parent / KUBERAY_CHECKS
        if path not in checks:
            checks[path] = None
            if readable(path, declared):
                try:
                    checks[path] = (path, read_json(path, "kuberay checks", 1, "kuberay_checks"))
                except ResultsError:  # the card says the checks were not run
                    pass
        advice = sd_advice.get(run.machine)
        attached.append(replace(run, sd_advice=None if advice is None else freeze(advice), kuberay=checks[path]))
    return attached
