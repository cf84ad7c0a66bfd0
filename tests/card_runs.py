"""Run records for card tests, shaped like a real metrics.json (keys as distlab.rank.worker
writes them) with every figure chosen by the test: a card's sentences can then be checked
against the numbers they claim to come from, without training anything. Each goes through the
one writer and the one reader of metrics.json (distlab.records.run_outputs), as a real run does,
and is handed to the cards as the report's door hands it: a typed ReportRun (distlab.report.report_run).
A test changes a run as a new one, in memory: `changed` (its metrics.json fields), `beside` (what
load_run reads beside it), `timed` (its steps and the throughput spread collect computes from them);
`report_run` reads a run folder (a harness run's) as the report does, with nothing beside it."""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from conftest import resolve

from distlab.records.metrics import METRICS_SCHEMA_VERSION
from distlab.records.run_outputs import RECORD_TEXT_FIELDS, RunRecord, read_run_record, write_metrics
from distlab.records.spec import Spec, freeze
from distlab.report.report_run import ReportRun

_TIMING = {"n": 4, "median": 0.1, "min": 0.09, "max": 0.12, "p25": 0.095, "p75": 0.11}


def fake_run(run_dir, overrides: dict, stage: str = "ddp", *, as_built: dict | None = None,
             comm_median_s: float | None = 0.01, losses=(3.0, 2.5, 2.0), step_median_s: float = 0.1,
             state_bytes: dict | None = None, budget: dict | None = None, status: str = "ok",
             others_cores: float | None = 0.0) -> ReportRun:
    spec = resolve(overrides, stage)
    world = spec["world_size"]
    timing = dict(_TIMING, median=step_median_s, p25=step_median_s * 0.95, p75=step_median_s * 1.1)
    tokens_per_step = spec["micro_batch"] * spec["grad_accum"] * world * spec["seq_len"]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_metrics(run_dir, {
        "schema_version": METRICS_SCHEMA_VERSION, "experiment": spec["id"], "stage": stage, "machine": "testbox",
                            "status": status, "spec": spec,
        "as_built": {"strategy": spec["strategy"], "outer_wrapper": "DistributedDataParallel",
                   "wrappers_found": ["DistributedDataParallel"], "world_size": world, "backend": "gloo",
                   "data_parallel_size": world, "device": "cpu", **(as_built or {})},
        "parameters": {"total": 1000, "trainable": 1000},
        "loss": {"first": losses[0], "last": losses[-1], "per_step": list(losses)},
        "timing": {"step_time_s": timing, "comm_inflight_s_per_step": dict(_TIMING, median=comm_median_s),
                   "comm_how": "test"},
        "throughput": {"tokens_per_s": tokens_per_step / step_median_s, "tokens_per_step": tokens_per_step,
                       "samples_per_step": tokens_per_step // spec["seq_len"]},
        "memory": {"per_rank": [{"peak_rss_bytes": 2**20, "budget": copy.deepcopy(budget)} for _ in range(world)],
                   "model_state_bytes_per_rank": [dict(state_bytes or {"params": 4000, "grads": 4000,
                                                                        "optimizer": 8000})] * world},
        "data": {"epoch_size": 100, "reads": 8, "duplicate_reads": 0, "duplicate_fraction": 0.0,
                 "samples_read_by_every_rank": 0, "epoch_plan_disjoint": True, "epoch_plan_covered": 100,
                 "epoch_plan_dropped": 0, "per_rank_reads": [8] * world},
        # distlab.runtime.noise: others_cores None = not recorded; busy past the cores the run left free.
        "noise": None if others_cores is None else {
            "busy": others_cores > max(0, 2 - world) + 0.2, "others_cores": others_cores, "machine_cores": 2,
            "free_cores": max(0, 2 - world), "load_avg_1min": [1.0, 1.0]},
    })
    return report_run(run_dir)


def report_run(run_dir, **beside_it) -> ReportRun:
    """The run in run_dir as the report's door hands it on (collect.load_run), with what it reads
    beside the file left empty unless given: each test sets what it checks."""
    return _with_nothing_beside(read_run_record(Path(run_dir) / "metrics.json"), str(run_dir), beside_it)


def _with_nothing_beside(record: RunRecord, folder: str, beside_it: dict) -> ReportRun:
    fields = dict(path=str(record.path), folder=folder, steps=(), validation=None, devices=None,
                  pipeline_records=(), job_wall_s=None, samples_png=None, throughput_spread=None)
    fields.update({name: freeze(value) for name, value in beside_it.items()})
    return ReportRun(record, **fields)


def from_metrics(metrics: dict, folder: str = "d", **beside_it) -> ReportRun:
    """A ReportRun of a partial metrics.json held in memory (only the fields a card test reads;
    never written, so not checked against the schema): `beside_it` as report_run takes them."""
    record = _record_of({"machine": "box", "status": "ok", **metrics}, Path(folder) / "metrics.json")
    return _with_nothing_beside(record, str(folder), beside_it)


def _record_of(data: dict, path: Path) -> RunRecord:
    """A RunRecord of a metrics dict held in memory, built as read_run_record builds one."""
    return RunRecord(path, *(data[name] for name in RECORD_TEXT_FIELDS), spec=Spec(data["spec"]), data=freeze(data))


def changed(run: ReportRun, **fields) -> ReportRun:
    """The run with these metrics.json fields set, in memory (its file is left as it is: a run of a
    shared fixture stays whole for the next test)."""
    return replace(run, record=_record_of(run.record.updated(**fields), run.record.path))


def beside(run: ReportRun, **fields) -> ReportRun:
    """The run with these files beside it as collect.load_run reads them (validation, devices ...)."""
    return replace(run, **{name: freeze(value) for name, value in fields.items()})


def timed(run: ReportRun, steps) -> ReportRun:
    """The run with these steps.jsonl rows and the throughput spread collect computes from them."""
    from distlab.report.collect import throughput_stats

    rows = tuple(freeze(dict(row)) for row in steps)
    return replace(run, steps=rows, throughput_spread=throughput_stats(run.record, rows))
