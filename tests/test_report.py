"""The milestone report: measured cards, honest comparisons, evidence that resolves,
refusal of files it cannot trust, and `snakemake --report` output."""
from __future__ import annotations

import csv
import json
import re
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import snakemake
from distlab.report.collect import ResultsError, clear_winner, load_run, throughput_stats
from distlab.report.report_run import ThroughputSpread
pytest_plugins = ["report_fixtures"]
MACHINE = "testbox"  # report_fixtures.MACHINE (not imported: the plugin module must load first)


def _spread_of_steps(tmp_path, times, repeats, tokens=1000):
    """throughput_stats of a run of `tokens` per step whose steps.jsonl holds these step times
    after one untimed step."""
    from card_runs import changed, fake_run

    run = fake_run(tmp_path / "run", {"world_size": 1, "micro_batch": 8, "repeats": repeats, "steps": 12})
    run = changed(run, throughput={**run.throughput, "tokens_per_step": tokens})
    steps = [{"step_time_s": 9.9, "untimed": True}] + [{"step_time_s": t, "untimed": False} for t in times]
    return throughput_stats(run.record, steps)


def test_repeats_split_timed_steps_into_windows_with_median_and_spread(tmp_path):
    stats = _spread_of_steps(tmp_path, [1.0, 1.0, 2.0, 2.0, 4.0, 4.0], repeats=3)
    assert stats.windows == (1000.0, 500.0, 250.0)  # warm-up step left out
    assert (stats.median, stats.low, stats.high) == (500.0, 250.0, 1000.0)


def test_single_repeat_spread_is_the_step_time_interquartile_range(tmp_path):
    stats = _spread_of_steps(tmp_path, [1.0, 2.0, 3.0, 4.0, 5.0], repeats=1)
    assert stats.median == pytest.approx(1000 / 3.0)
    assert stats.low == pytest.approx(1000 / 4.0) and stats.high == pytest.approx(1000 / 2.0)


def test_overlapping_spreads_are_no_clear_winner(tmp_path):
    from card_runs import fake_run

    run = fake_run(tmp_path / "run", {"world_size": 1, "micro_batch": 8})

    def spread(low, high):
        return replace(run, throughput_spread=ThroughputSpread(median=(low + high) / 2, low=low, high=high,
                                                               windows=(), repeats=1, how="test"))

    a, b, c = spread(90.0, 110.0), spread(105.0, 130.0), spread(120.0, 140.0)
    assert not clear_winner(a, b) and clear_winner(a, c)


def test_repeats_need_two_timed_steps_per_window():
    from conftest import resolve
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"experiments\[0\]\.repeats"):
        resolve({"repeats": 3}, steps=6, untimed_steps=2)


@pytest.mark.slow
def test_report_shows_every_stage_card_and_the_cross_stage_sections(finished_pipeline):
    work, _ = finished_pipeline
    readme = (work / "results" / "report" / "README.md").read_text()
    html = (work / "results" / "report" / "index.html").read_text()
    for section in ("What to run here, and where you stand", "Advisor: what to run", "Stage 1 - PyTorch DDP",
                    "Strategy ranking",
                    "Communication: collective bandwidth", "Loss curves per stage"):
        assert section in readme and section in html
    # Goals are computed: stage 1 ran, stages without runs say so instead of passing.
    assert "**passed** (minimal) DDP training ran on 2+ ranks" in readme
    assert re.search(r"\*\*not run\*\* \(minimal\)", readme)
    assert html.count("data:image/png;base64,") >= 4 and "<script" not in html


@pytest.mark.slow
def test_every_evidence_link_points_at_a_file_that_exists(finished_pipeline):
    work, _ = finished_pipeline
    report_dir = work / "results" / "report"
    links = re.findall(r"\[evidence\]\(([^)]+)\)", (report_dir / "README.md").read_text())
    assert links
    for link in links:
        assert (report_dir / link).is_file(), link


@pytest.mark.slow
def test_summary_carries_throughput_spread_and_repeats(finished_pipeline):
    work, _ = finished_pipeline
    rows = list(csv.DictReader(open(work / "results" / "summary.csv")))
    two = next(r for r in rows if r["experiment"] == "ddp-full-w2-mb4-ga1")
    assert two["repeats"] == "2"
    assert float(two["tokens_per_s_low"]) <= float(two["tokens_per_s"]) <= float(two["tokens_per_s_high"])


@pytest.mark.slow
def test_bandwidth_section_derives_the_break_even_batch_from_measurements(finished_pipeline):
    work, _ = finished_pipeline
    bench = json.loads((work / "results" / MACHINE / "collectives.json").read_text())
    assert bench["world_size"] == 2 and {r["op"] for r in bench["results"]} == {"all_reduce", "all_gather",
                                                                                 "reduce_scatter"}
    assert all(r["status"] == "ok" and r["busbw_bytes_per_s"] > 0 for r in bench["results"])
    readme = (work / "results" / "report" / "README.md").read_text()
    # Markdown-escaped (distlab.report.render.md): `*` is written `\*`, so it stays a character.
    assert re.search(r"2 ranks beat 1 once the global batch exceeds B\\\* = a\\\*N/\(c\\\*\(N-1\)\) = [0-9.]+ samples",
                     readme)
    assert "Measured at global batch 8" in readme


@pytest.mark.slow
def test_advisor_estimate_is_checked_against_the_runs(finished_pipeline):
    work, _ = finished_pipeline
    advice = json.loads((work / "results" / MACHINE / "advice.json").read_text())
    assert advice["recommendation"] == "ddp"
    readme = (work / "results" / "report" / "README.md").read_text()
    assert "Estimate vs measured on testbox" in readme
    # fp32 DDP: 16 bytes/param of weights, grads and AdamW, plus 4 of DDP's gradient buckets (both measured).
    assert "The estimate was wrong for 0 of 2 run(s)." in readme


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_text("{not json"), "unreadable metrics file"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "schema_version": 99})),
     "schema_version 99"),
])
def test_corrupt_or_foreign_results_are_refused_naming_the_file(finished_pipeline, tmp_path, damage, message):
    work, _ = finished_pipeline
    metrics = tmp_path / "metrics.json"
    metrics.write_text((work / "results" / MACHINE / "ddp-full-w1-mb8-ga1" / "metrics.json").read_text())
    damage(metrics)
    with pytest.raises(ResultsError, match=re.escape(str(metrics)) + ".*" + re.escape(message)):
        load_run(metrics)


@pytest.mark.slow
def test_validation_json_travels_with_its_run(finished_pipeline, tmp_path):
    import shutil

    work, _ = finished_pipeline
    run_dir = tmp_path / MACHINE / "ddp-full-w1-mb8-ga1"  # a run sits in folders named as it says
    shutil.copytree(work / "results" / MACHINE / "ddp-full-w1-mb8-ga1", run_dir)
    (run_dir / "validation.json").write_text(json.dumps(
        {"schema_version": 1, "experiment": "ddp-full-w1-mb8-ga1", "passed": False,
         "checks": {"reload": {"status": "failed"}}}))
    assert load_run(run_dir / "metrics.json").validation.passed is False
    (run_dir / "validation.json").write_text(json.dumps({"schema_version": 7}))
    with pytest.raises(ResultsError, match="validation.json: validation schema_version 7"):
        load_run(run_dir / "metrics.json")


@pytest.mark.slow
def test_snakemake_report_zip_has_categories_and_labels(finished_pipeline):
    work, cfg = finished_pipeline
    snakemake(work, "--report", "report.zip", config=cfg)
    with zipfile.ZipFile(work / "report.zip") as archive:
        names = archive.namelist()
    text = " ".join(names)
    for produced in ("summary.csv", "index.html", "collectives.json", "advice.md"):
        assert produced in text, produced
    assert Path(work / "report.zip").stat().st_size > 10_000


def test_overview_counts_a_stage_whose_bonus_goals_only_partly_ran():
    from distlab.report.build import overview_card
    from distlab.report.cards import NOT_RUN, PASSED, Card, Goal

    card = Card(5, "Stage 5", goals=[Goal("minimal", "ran", PASSED), Goal("bonus", "a", PASSED),
                                     Goal("bonus", "b", NOT_RUN), Goal("bonus", "c", NOT_RUN)])
    row = overview_card([card], [], {}).tables[0].frame.iloc[0]
    assert row["minimal"] == PASSED and row["bonus"] == "1 of 3 passed"


def _as_machine(folder: Path, machine: str) -> None:
    """A copied-in machine folder: every JSON file that names its machine names `machine`."""
    for path in folder.rglob("*.json"):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("machine") == MACHINE:
            path.write_text(json.dumps(dict(data, machine=machine)))


@pytest.mark.slow
def test_the_report_reads_only_what_its_rule_declares(finished_pipeline, tmp_path, monkeypatch):
    """Rule report's inputs (as Snakemake resolves them) cover every file the report opens, for
    this machine's runs and a copied-in machine's; and every file beside a run is read, so no
    declaration is missing (a file the rule does not declare is not read at all)."""
    import builtins
    import io
    import shutil

    from distlab.report.build import report_rule
    from distlab.report.inputs import declared_inputs
    from distlab.records.run_layout import MACHINE_FILES, RUN_SIDE_FILES

    work, cfg = finished_pipeline
    results = tmp_path / "results"
    shutil.copytree(work / "results", results, ignore=shutil.ignore_patterns("checkpoint", "report", "tracking"))
    shutil.copytree(results / MACHINE, results / "otherbox")
    _as_machine(results / "otherbox", "otherbox")
    plan = snakemake(tmp_path, "-n", "results/report/index.html", config=cfg).stdout
    (line,) = re.findall(r"rule report:\n\s+input: (.*)\n", plan)
    inputs = [str(tmp_path / p) for p in line.split(", ")]
    read = []

    def recording_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and "r" in mode and str(file).startswith(str(results)):
            read.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    real_open = io.open
    monkeypatch.setattr(io, "open", recording_open)
    monkeypatch.setattr(builtins, "open", recording_open)
    (summary,) = [p for p in inputs if p.endswith("/summary.csv")]
    report_rule([p for p in inputs if p.endswith("/metrics.json")], summary, [str(results / MACHINE / "advice.json")],
                declared_inputs(inputs), tmp_path / "out" / "index.html", tmp_path / "out" / "README.md")
    monkeypatch.undo()
    declared = declared_inputs(inputs)
    assert [p for p in read if not any(str(d) in declared for d in (Path(p), *Path(p).parents))] == []
    metrics = [p for p in read if p.endswith("/metrics.json")]
    assert metrics and len(metrics) == len(set(metrics)), "each run's metrics.json is read once"
    assert read.count(summary) == 1, "summary.csv is read, not recomputed"
    beside = [run / name for machine in (MACHINE, "otherbox") for run in (results / machine).iterdir()
              if (run / "metrics.json").is_file() for name in RUN_SIDE_FILES if (run / name).is_file()]
    machine_files = [results / m / name for m in (MACHINE, "otherbox") for name in MACHINE_FILES]
    present = [str(p) for p in beside + machine_files if p.is_file()]
    assert len(present) >= 2 * 2 * 3 + 2 * 3  # steps, devices, benchmark of 2 runs, 3 machine files, twice
    assert [p for p in present if p not in read] == []
