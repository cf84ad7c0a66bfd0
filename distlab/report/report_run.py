"""One run as the summary and the report read it (`ReportRun`): its metrics.json record, typed
(distlab.records.run_outputs.RunRecord), and the files beside it that collect.load_run read.

Cards read a run by attribute, never as a dict: `run.spec.sampler`, `run.throughput.tokens_per_s`,
`run.throughput_spread.low`, `run.steps`. The sections of metrics.json that a run may lack
(eval, prediction, memory_estimate, checkpoint ...) are read with `run.section("eval")`: None
when the file holds none, an AttributeError for a name the results schema does not declare (a
misspelt section is an error, never a silent None). A ReportRun is frozen: what a later reader
adds (the machine's advice-sd.json, the kuberay checks) makes a new one (dataclasses.replace).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from distlab.records.run_outputs import RunRecord
from distlab.records.spec import Block, FrozenList


@dataclass(frozen=True)
class ThroughputSpread:
    """A run's throughput in its own unit with the spread the report compares runs by
    (collect.throughput_stats says how each is computed)."""
    median: float
    low: float
    high: float
    windows: tuple[float, ...]  # one figure per launch or step-time window; empty: one window
    repeats: int
    how: str  # how the spread was computed, in words, for the cards' notes
    timed_steps: int | None = None  # None: no steps.jsonl was read
    launches: int | None = None  # spec launches >= 2: the number of independent launches


@functools.lru_cache(maxsize=1)
def declared_sections() -> frozenset[str]:
    """The metrics.json sections the results schema declares (results_schema.yaml: the metrics
    kind's properties and those an ok run adds), the only names ReportRun.section reads."""
    import yaml

    schemas = yaml.safe_load(Path(__file__).with_name("results_schema.yaml").read_text())
    metrics = schemas["metrics"]
    return frozenset(metrics["properties"]) | frozenset(schemas["$defs"]["ok_run"]["properties"])


class _FromRecord:
    """A ReportRun attribute read from its record's attribute of the same name."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, run, owner=None):
        return self if run is None else getattr(run.record, self.name)


@dataclass(frozen=True)
class ReportRun:
    """One run of the report's run table: the record and what lies beside it, read once by
    collect.load_run (cards open no file)."""
    record: RunRecord
    path: str  # its metrics.json
    folder: str  # the run's folder (absolute once the report's door has read it)
    steps: tuple  # steps.jsonl's rows (FrozenDicts); empty when not recorded or not declared
    validation: Block | None  # validation.json (checkpoint checks)
    devices: Block | None  # devices.json (the GPU ids the run held)
    pipeline_records: tuple  # run_files/pipeline-rank<r>.json (the parallel card reads them)
    job_wall_s: float | None  # the train job's wall time (benchmark.tsv)
    samples_png: bytes | None  # the text-to-image sample grid
    throughput_spread: ThroughputSpread | None  # ok runs with a throughput (collect.throughput_stats)
    # Read once per machine or results folder by collect.attach_machine_records (the report only):
    sd_advice: Block | None = None  # its machine's advice-sd.json
    kuberay: tuple | None = None  # (path, record) of its results folder's kuberay/checks.json

    # What every reader names, typed, read straight from the record (RunRecord): the text fields,
    # the spec, the unit, and the sections RunRecord reads by attribute (Blocks; None where absent).
    # Not annotated, so not dataclass fields: the record holds them.
    experiment = _FromRecord()  # str
    machine = _FromRecord()  # str
    stage = _FromRecord()  # str
    status = _FromRecord()  # str
    spec = _FromRecord()  # Spec
    unit = _FromRecord()  # str: what the throughput counts (its task's unit: token, image)
    units_per_s = _FromRecord()  # float: the throughput in that unit
    timing = _FromRecord()  # Block | None
    throughput = _FromRecord()  # Block | None
    memory = _FromRecord()  # Block | None
    as_built = _FromRecord()  # Block | None
    loss = _FromRecord()  # Block | None
    noise = _FromRecord()  # Block | None
    optimization = _FromRecord()  # Block | None

    def section(self, name: str):
        """A section of metrics.json the results schema declares (a Block, a FrozenList or a
        value), None when this run's file holds none; a name the schema does not declare is an
        AttributeError (a misspelt section must not read as absent)."""
        if name not in declared_sections():
            known = ", ".join(sorted(declared_sections()))
            raise AttributeError(f"metrics.json has no section {name!r} in the results schema "
                                 f"(distlab/report/results_schema.yaml declares {known})")
        return self.record.data.get(name)

    @property
    def launches(self) -> FrozenList:
        """What each launch measured (spec launches >= 2, distlab.jobs.launches); empty for one launch."""
        return self.section("launches") or FrozenList()

    @functools.cached_property
    def metrics(self) -> Block:
        """The whole file, read-only, its spec typed: what the records-level readers shared with
        the harness take (memory_check, predictions, memory_phases read a metrics mapping)."""
        return Block({**self.record.data, "spec": self.record.spec})
