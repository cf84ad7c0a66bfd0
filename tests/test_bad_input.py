"""A good config edited into a bad one: the workflow stops before any job, names the field
or file, and every finished result (prepared data, base model, runs, report) stays as it was.

Snakemake deletes a job's outputs before it reruns the job, so bad input found inside a job
would cost the finished result it replaces: the checks must come before any job."""
import copy
import importlib.util
import json
import shutil

import pytest

from conftest import snakemake

pytest_plugins = ["report_fixtures"]
# Every test reruns the session's finished workflow (report_fixtures).
pytestmark = pytest.mark.slow


def nan_lr(cfg, work):
    cfg["stages"]["ddp"]["experiments"][1]["lr"] = float("nan")
    return "stages.ddp.experiments.1.lr"


def float_world_size(cfg, work):
    cfg["stages"]["ddp"]["experiments"][1]["world_size"] = 2.0
    return "stages.ddp.experiments.1.world_size"


def junk_model_config(cfg, work):
    folder = work / "user-model"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(work / "results" / "prep" / "model", folder)
    (folder / "config.json").write_text("this is not json\n")
    cfg["model"]["path"] = str(folder)
    return f"{folder / 'config.json'} is not valid JSON (line 1"


def jsonl_without_text_field(cfg, work):
    if importlib.util.find_spec("distlab.configuration.data_checks") is None:
        pytest.skip("data-file content checks (distlab.configuration.data_checks) are not in this branch")
    path = work / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"row {i}"}) for i in range(20)) + "\n")
    cfg["data"].update(source="files", files=[str(path)])
    return str(path)


@pytest.mark.parametrize("edit", [nan_lr, float_world_size, junk_model_config, jsonl_without_text_field],
                         ids=lambda f: f.__name__)
def test_a_bad_edit_is_named_and_loses_nothing_finished(finished_pipeline, edit):
    work, good = finished_pipeline
    results = work / "results"
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in results.rglob("*") if p.is_file()}
    assert any(p.name == "metrics.json" for p in before) and any("prep" in p.parts for p in before)
    bad = copy.deepcopy(good)
    named = edit(bad, work)
    proc = snakemake(work, "--cores", "2", config=bad, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert named in output, output[-3000:]
    assert "rule train" not in output and "localrule" not in output  # no job started
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in results.rglob("*") if p.is_file()}
    assert after == before
