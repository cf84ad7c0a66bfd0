"""Results shared between machines: copying another machine's folder in (or listing it in
extra_results) gives one combined report; nothing is overwritten or lost.

The second machine is FABRICATED: a copy of a real run folder from the tiny pipeline with
its machine tag changed. It proves the merge mechanics, not a second machine's speed.
"""
from __future__ import annotations

import csv
import hashlib
import json
import shutil

import pytest

from conftest import snakemake

pytest_plugins = ["report_fixtures"]
MACHINE = "testbox"


def fake_second_machine(source_machine_dir, target_dir, tag):
    """Copy a real machine folder and retag it, as if it came from another machine."""
    shutil.copytree(source_machine_dir, target_dir, ignore=shutil.ignore_patterns("checkpoint"))
    for path in list(target_dir.glob("*/metrics.json")) + [target_dir / "hardware.json",
                                                            target_dir / "collectives.json"]:
        data = json.loads(path.read_text())
        data["machine"] = tag
        path.write_text(json.dumps(data))
    return target_dir


def digests(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and ".snakemake" not in p.parts}


@pytest.fixture
def workcopy(finished_pipeline, tmp_path):
    work, cfg = finished_pipeline
    copy = tmp_path / "work"
    shutil.copytree(work, copy, symlinks=True)
    return copy, json.loads(json.dumps(cfg))


@pytest.mark.slow
def test_copied_machine_folder_merges_into_one_report_side_by_side(workcopy):
    work, cfg = workcopy
    results = work / "results"
    fake_second_machine(results / MACHINE, results / "otherbox", "otherbox")
    before = digests(results / MACHINE) | {f"otherbox/{k}": v for k, v in digests(results / "otherbox").items()}
    snakemake(work, "--cores", "2", config=cfg)
    rows = list(csv.DictReader(open(results / "summary.csv")))
    assert sorted((r["machine"], r["experiment"]) for r in rows) == [
        ("otherbox", "ddp-full-w1-mb8-ga1"), ("otherbox", "ddp-full-w2-mb4-ga1"),
        ("testbox", "ddp-full-w1-mb8-ga1"), ("testbox", "ddp-full-w2-mb4-ga1")]
    readme = (results / "report" / "README.md").read_text()
    assert "## Machines side by side" in readme
    assert "| experiment" in readme and "otherbox" in readme and "testbox" in readme
    # A copied run has identical timings: the comparison must not invent a winner.
    assert "no clear winner" in readme.split("## Machines side by side")[1].split("\n## ")[0]
    after = digests(results / MACHINE) | {f"otherbox/{k}": v for k, v in digests(results / "otherbox").items()}
    assert {k: after[k] for k in before} == before, "a merge must not rewrite any machine's files"


@pytest.mark.slow
def test_extra_results_folder_is_merged_without_copying_it_in(workcopy, tmp_path):
    work, cfg = workcopy
    elsewhere = tmp_path / "from-the-gpu-box" / "results"
    fake_second_machine(work / "results" / MACHINE, elsewhere / "gpubox", "gpubox")
    cfg["extra_results"] = [str(elsewhere)]
    snakemake(work, "--cores", "2", "results/summary.csv", config=cfg)  # the report path is tested above
    machines = {r["machine"] for r in csv.DictReader(open(work / "results" / "summary.csv"))}
    assert machines == {"testbox", "gpubox"}
    assert not (work / "results" / "gpubox").exists()


def test_same_experiment_of_the_same_machine_twice_is_refused(workcopy, tmp_path):
    from distlab.report.collect import ResultsError, load_runs

    work, _ = workcopy
    twin = tmp_path / "twin" / MACHINE
    shutil.copytree(work / "results" / MACHINE, twin, ignore=shutil.ignore_patterns("checkpoint"))
    original = work / "results" / MACHINE / "ddp-full-w1-mb8-ga1" / "metrics.json"
    with pytest.raises(ResultsError, match="the same experiment of machine 'testbox' twice"):
        load_runs([original, twin / "ddp-full-w1-mb8-ga1" / "metrics.json"])


def test_untrustworthy_results_from_other_machines_are_named_and_left_out(workcopy):
    work, cfg = workcopy
    results = work / "results"
    run = "ddp-full-w1-mb8-ga1"
    corruptions = {
        "stepsbox": ("steps.jsonl", lambda text: text[:-40] + "\n{broken", "steps.jsonl: line"),
        "lossbox": ("metrics.json", lambda m: {k: v for k, v in m.items() if k != "loss"}, "field 'loss': missing"),
        "speedbox": ("metrics.json", lambda m: {k: v for k, v in m.items() if k != "throughput"},
                     "field 'throughput': missing"),
        "oldbox": ("metrics.json", lambda m: dict(m, schema_version=99), "schema_version 99"),
    }
    for tag, (name, corrupt, _) in corruptions.items():
        fake_second_machine(results / MACHINE, results / tag, tag)
        path = results / tag / run / name
        if name == "metrics.json":
            path.write_text(json.dumps(corrupt(json.loads(path.read_text()))))
        else:
            path.write_text(corrupt(path.read_text()))
    snakemake(work, "--cores", "2", "results/summary.csv", "results/report/index.html", config=cfg)
    rows = {(r["machine"], r["experiment"]) for r in csv.DictReader(open(results / "summary.csv"))}
    assert not {(tag, run) for tag in corruptions} & rows  # each bad run left out...
    assert {(tag, "ddp-full-w2-mb4-ga1") for tag in corruptions} <= rows  # ...its good neighbours kept
    rejected = {item["path"]: item["reason"] for item in json.loads((results / "summary-rejected.json").read_text())}
    for tag, (name, _, reason) in corruptions.items():
        path = f"results/{tag}/{run}/metrics.json"  # the workflow's relative path
        assert path in rejected and reason in rejected[path], rejected
    assert "left out of the report" in (results / "logs" / "report.log").read_text()
