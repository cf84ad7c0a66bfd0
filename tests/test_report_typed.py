"""One typed contract between the phases (issue 42): the summary and the report read each run as a
typed ReportRun, never as the dict RunRecord.to_dict() makes; that dict is for the harness
(distlab/testing.py, benchmarks/) and RunRecord.updated, the door of metrics.json's writes."""
from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from card_runs import fake_run, report_run

REPO = Path(__file__).resolve().parents[1]
# The harness may hand tests a dict of a run; production code may not.
HARNESS = {"distlab/testing.py"}


def production_python() -> list[Path]:
    files = [*(REPO / "distlab").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]
    return sorted(p for p in files if "vendor" not in p.parts and str(p.relative_to(REPO)) not in HARNESS)


def record_to_dict_calls(path: Path) -> list[str]:
    """`.to_dict()` called on a RunRecord: on read_run_record(...) itself, on a name bound to
    one, on a ReportRun's `.record`, or on `self` in RunRecord outside `updated` (the write door)."""
    tree = ast.parse(path.read_text())
    records = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "read_run_record"
               for target in node.targets if isinstance(target, ast.Name)}
    door = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == "RunRecord"
            for method in cls.body if isinstance(method, ast.FunctionDef) and method.name == "updated"
            for node in ast.walk(method)}
    inside_record = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == "RunRecord"
                     for node in ast.walk(cls)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to_dict"):
            continue
        receiver = node.func.value
        on_record = ((isinstance(receiver, ast.Call) and getattr(receiver.func, "id", "") == "read_run_record")
                     or (isinstance(receiver, ast.Name) and receiver.id in records)
                     or (isinstance(receiver, ast.Attribute) and receiver.attr == "record")
                     or (isinstance(receiver, ast.Name) and receiver.id == "self" and id(node) in inside_record
                         and id(node) not in door))
        if on_record:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_production_code_reads_a_run_record_as_a_dict():
    calls = [call for path in production_python() for call in record_to_dict_calls(path)]
    # The workflow's rules and Snakefile are Python to Snakemake, not to ast: read as text.
    for path in sorted([*(REPO / "rules").glob("*.smk"), REPO / "Snakefile"]):
        calls += [f"{path.relative_to(REPO)}: {line.strip()}" for line in path.read_text().splitlines()
                  if re.search(r"read_run_record\(.*\)\.to_dict\(\)|record\.to_dict\(\)", line)]
    assert calls == []


def test_the_check_finds_a_record_read_as_a_dict(tmp_path):
    """The check above is not vacuous: each way a record reaches to_dict() is found."""
    source = tmp_path / "reader.py"
    source.write_text("record = read_run_record(p)\na = record.to_dict()\nb = read_run_record(p).to_dict()\n"
                      "c = run.record.to_dict()\nd = model.config.to_dict()\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert [call.split(" ", 1)[1] for call in record_to_dict_calls(source)] == [
            "record.to_dict()", "read_run_record(p).to_dict()", "run.record.to_dict()"]
    finally:
        REPO = saved


def test_a_report_run_is_read_by_attribute_never_as_a_dict(tmp_path):
    from distlab.report.report_run import ReportRun, declared_sections

    assert not hasattr(ReportRun, "__getitem__") and not issubclass(ReportRun, (dict, Mapping))
    run = fake_run(tmp_path / "run", {"world_size": 2, "micro_batch": 4})
    with pytest.raises(TypeError):
        run["spec"]  # what a card may not do
    assert run.spec.world_size == 2 and run.throughput.tokens_per_step == run.record.throughput.tokens_per_step
    assert {"eval", "prediction", "memory_estimate", "checkpoint"} <= declared_sections()
    assert run.section("eval") is None  # declared by the results schema, absent from this run's file
    assert run.section("parameters").total == 1000
    with pytest.raises(AttributeError, match="'evall'"):
        run.section("evall")  # a misspelt section is an error, never a silent None
    with pytest.raises(AttributeError):
        run.thoughput  # a misspelt field, likewise
    with pytest.raises(TypeError):
        run.spec.__setitem__("world_size", 4)  # frozen, as the record is


def test_the_summary_and_the_report_are_built_without_a_records_dict(tmp_path, monkeypatch):
    """Runs read as the rules read them, then RunRecord.to_dict made to fail: the summary and
    every card of the report are built all the same."""
    from distlab.records.run_outputs import RunRecord, write_metrics
    from distlab.report.build import read_inputs, report_sections
    from distlab.report.collect import load_checked_runs
    from distlab.report.held_out import eval_columns
    from distlab.report.render import render_markdown
    from distlab.report.summary_table import spreadsheet_safe, summary_frame

    paths = []
    for name, overrides, stage in (("a", {"world_size": 1, "micro_batch": 8}, "ddp"),
                                   ("b", {"world_size": 2, "micro_batch": 4}, "ddp"),
                                   ("c", {"strategy": "fsdp", "world_size": 2, "micro_batch": 4}, "fsdp")):
        run = fake_run(tmp_path / "scratch" / name, overrides, stage)
        folder = tmp_path / "results" / run.machine / run.experiment  # a run sits in folders named as it says
        shutil.copytree(run.folder, folder)
        write_metrics(folder, run.record.updated(versions={"torch": "2.13.0"}))
        paths.append(str(folder / "metrics.json"))

    def refused(self):
        raise AssertionError("RunRecord.to_dict() called by the summary or the report")

    monkeypatch.setattr(RunRecord, "to_dict", refused)
    runs, rejected = load_checked_runs(paths)
    assert rejected == [] and len(runs) == 3
    summary = tmp_path / "summary.csv"
    spreadsheet_safe(eval_columns(summary_frame(runs), runs)).to_csv(summary, index=False)
    sections = report_sections(read_inputs(runs, summary))
    assert "Strategy ranking across all runs" in render_markdown(sections, [{"machine": "testbox"}], str(tmp_path), "")
    assert report_run(Path(paths[0]).parent).experiment == runs[0].experiment
