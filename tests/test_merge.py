"""Results shared between machines: copying another machine's folder in (or listing it in
extra_results) gives one combined report; nothing is overwritten or lost.

The second machine is FABRICATED: a copy of a real run folder from the tiny pipeline with
its machine tag changed. It proves the merge mechanics, not a second machine's speed.
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
import socket
import stat
from pathlib import Path

import pytest

from conftest import REPO, snakemake

pytest_plugins = ["report_fixtures"]
# Every test reads or reruns the session's finished workflow (report_fixtures).
pytestmark = pytest.mark.slow
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


# Copied in by report_fixtures.seed_prepared (by this process), not written by the workflow.
SEEDED = ("prep/tokenizer", "prep/data", "prep/model", f"{MACHINE}/hardware.json")


def _text(path):
    try:
        return path.read_text()
    except (UnicodeDecodeError, ValueError):
        return None  # binary (weights, optimizer state, sqlite): no text to scan


def test_a_machine_folder_names_no_host_or_local_path_and_no_other_user_can_read_results(finished_pipeline):
    """A real run with `machine:` set, as a user shares it: no text file of results/<machine>/
    holds this host's name (nor any file name), none but the logs (the machine's own
    diagnostics) holds the checkout's, working folder's or home folder's absolute path, and
    nothing the workflow wrote under results/ (prep's files included) is readable by others."""
    work, _ = finished_pipeline
    results = work / "results"
    host = re.compile(r"(?<![A-Za-z0-9])" + re.escape(socket.gethostname()) + r"(?![A-Za-z0-9])")
    local = [f"{REPO}/", f"{work}/", f"{Path.home()}/"]
    named, located = [], []
    for path in sorted((results / MACHINE).rglob("*")):
        if host.search(path.name):
            named.append(str(path))
        text = _text(path) if path.is_file() else None
        if text is None:
            continue
        if host.search(text):
            named.append(str(path))
        if not path.name.endswith(".log") and any(prefix in text for prefix in local):
            located.append(str(path))
    assert not named, named
    assert not located, located
    seeded = [results / name for name in SEEDED]
    readable = [f"{oct(p.stat().st_mode & 0o777)} {p}" for p in sorted(results.rglob("*"))
                if p.stat().st_mode & stat.S_IRWXO and not any(p == s or s in p.parents for s in seeded)
                and p not in (results / "prep", results / MACHINE)]  # made by the seeding too
    assert not readable, readable
    assert any(p.is_file() for p in (results / "prep" / "eval").iterdir())  # prep's own files were checked
