"""A run's two result files: metrics.json (strict JSON) and steps.jsonl. metrics.json has one
writer (write_metrics) and one reader (read_run_record): a record that does not hold this
schema version and the fields every reader needs is refused with the file named."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distlab.records.metrics import METRICS_SCHEMA_VERSION
from distlab.records.sharing import portable
from distlab.records.spec import Block, Spec, freeze, thaw

# Larger than any results file distlab writes (a metrics.json of 100k steps is ~3 MB): such a
# file is refused before it is read into memory.
MAX_RESULTS_FILE_BYTES = 64 << 20


class ResultsError(ValueError):
    """A results file that cannot be trusted (corrupt, another schema version, a field of the
    wrong type or out of range), with the file named."""


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
    Paths of the checkout and home folder relative (distlab.records.sharing): the file is shared.
    Written beside and renamed over the old one, so a reader never sees half a file."""
    metrics = portable(json.loads(json.dumps(nan_to_none(metrics), default=str)))
    path = Path(run_dir) / "metrics.json"
    partial = path.with_name("metrics.json.partial")
    partial.write_text(json.dumps(metrics, indent=1))
    os.replace(partial, path)


# The task of a spec that names none (the config's default; every run written before tasks
# existed) and what a record's throughput counts when it names no unit (those runs': tokens).
DEFAULT_TASK = "causal-lm"
UNIT_BEFORE_TASKS = "token"


def task_of(spec: Mapping) -> str:
    """The task a spec trains (distlab/tasks)."""
    return spec.get("task", DEFAULT_TASK)


def throughput_unit(record: Mapping) -> str:
    """The unit a run's throughput counts, as the run recorded it (`throughput.unit`, its task's:
    tokens, images): its figures are `<unit>s_per_s`, `<unit>s_per_step`. Also one launch's
    entry of `launches` (distlab.jobs.launches), which names its unit the same way."""
    throughput = record.get("throughput", record) or {}
    return throughput.get("unit", UNIT_BEFORE_TASKS)


def one_line(metrics: dict) -> str:
    """A finished run in one line, for the terminal Snakemake runs the job in."""
    if metrics.get("status") != "ok":
        return f"{metrics['experiment']}: {metrics.get('status')}"
    loss, timing = metrics["loss"], metrics["timing"]["step_time_s"]
    unit = throughput_unit(metrics)
    trained = (metrics.get("eval") or {}).get("trained") or {}
    held_out = f", eval loss {trained['loss']:.3f}" if isinstance(trained.get("loss"), float) else ""
    return (f"{metrics['experiment']}: ok, {len(loss['per_step'])} steps, loss {loss['first']:.3f} -> "
            f"{loss['last']:.3f}{held_out}, {metrics['throughput'][f'{unit}s_per_s']:,.0f} {unit}s/s "
            f"(median step {timing['median'] * 1000:.0f} ms), {metrics['wall_seconds_rank0']:.0f} s")


def parse_json(text: str, path, what: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ResultsError(f"{path}: {what} is nested too deeply to be a distlab file; fix or remove it") from None


def read_json_object(path, what: str, version: int | None) -> dict:
    """A results file as a dict: readable, not oversized, a JSON object and (version) of this
    schema version; else ResultsError naming the file."""
    try:
        if Path(path).stat().st_size > MAX_RESULTS_FILE_BYTES:
            raise ResultsError(f"{path}: {what} file is larger than {MAX_RESULTS_FILE_BYTES >> 20} MB, which no "
                               "distlab file is; fix or remove it")
        data = parse_json(Path(path).read_text(), path, f"{what} file")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: unreadable {what} file ({exc}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: {what} file is not a JSON object; fix or remove it")
    if version is not None and data.get("schema_version") != version:
        raise ResultsError(f"{path}: {what} schema_version {data.get('schema_version')!r}, this distlab reads "
                           f"{version}; refusing to mix it into the report")
    return data


# The fields every reader of a run needs, typed; the rest stays in `data` (the report's JSON
# Schema, distlab/report/results_schema.yaml, checks those it reads).
RECORD_TEXT_FIELDS = ("experiment", "machine", "stage", "status")


@dataclass(frozen=True)
class RunRecord:
    """One run's metrics.json as read: the fields every reader needs, typed (the spec a typed
    Spec; timing, throughput, memory, as_built, loss as Blocks read by attribute:
    `record.timing.step_time_s.median`), and the whole file as a read-only mapping (`data`;
    lists are FrozenLists). The dict forms are for the doors only: `updated(**fields)` is the file's
    next version for write_metrics, to_dict() a fresh, mutable copy for the test harness and the
    benchmarks (the report reads the record typed: distlab.report.report_run.ReportRun)."""
    path: Path
    experiment: str
    machine: str
    stage: str
    status: str
    spec: Spec
    data: Mapping

    # The file's sections every reader names, read by attribute (`record.timing.step_time_s`).
    timing = throughput = memory = as_built = loss = noise = optimization = None  # filled below

    @property
    def unit(self) -> str:
        """What the run's throughput counts (its task's unit: token, image)."""
        return throughput_unit(self.data)

    @property
    def units_per_s(self) -> float:
        """The run's throughput in its own unit (tokens/s, images/s)."""
        return self.throughput[f"{self.unit}s_per_s"]

    def updated(self, **fields) -> dict:
        """The file's next version with these fields set: what a writer hands write_metrics."""
        return {**self.to_dict(), **fields}

    def to_dict(self) -> dict:
        """A fresh, mutable copy of the file, its spec the record's typed, frozen Spec (a reader
        changes a spec only by spec.replace)."""
        return {**thaw(self.data), "spec": self.spec}


class _Section:
    """A RunRecord attribute that reads its section of the file (a Block; None where absent)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, record, owner=None) -> Block | None:
        return self if record is None else record.data.get(self.name)


for _name in ("timing", "throughput", "memory", "as_built", "loss", "noise", "optimization"):
    _section = _Section()
    _section.__set_name__(RunRecord, _name)
    setattr(RunRecord, _name, _section)


def read_run_record(path) -> RunRecord:
    """The one reader of a run's metrics.json: this schema version (METRICS_SCHEMA_VERSION),
    experiment/machine/stage/status as text and spec as an object, else ResultsError naming the
    file and the field. Results written before 'as_built' was named 'actual' read as 'as_built'."""
    path = Path(path)
    data = read_json_object(path, "metrics", METRICS_SCHEMA_VERSION)
    if "actual" in data and "as_built" not in data:
        data["as_built"] = data.pop("actual")
    for name in RECORD_TEXT_FIELDS:
        if not isinstance(data.get(name), str):
            why = "missing" if name not in data else f"{data[name]!r} is not a string"
            raise ResultsError(f"{path}: field '{name}': {why}; fix or remove the file")
    if not isinstance(data.get("spec"), dict):
        why = "missing" if "spec" not in data else "not an object"
        raise ResultsError(f"{path}: field 'spec': {why}; fix or remove the file")
    # Frozen as a spec is (distlab.records.spec.freeze: one implementation): Blocks read by
    # attribute, lists as FrozenLists.
    frozen = freeze(data)
    return RunRecord(path, *(data[name] for name in RECORD_TEXT_FIELDS), spec=Spec(data["spec"]), data=frozen)
