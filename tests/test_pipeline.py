"""The workflow as a user runs it: `snakemake --cores all` on a tiny config in a temp folder."""
import copy
import json
import math
import re

import pytest
import yaml

from conftest import snakemake, tiny_config
from distlab.records.run_outputs import read_run_record

from report_fixtures import MACHINE, STAGES, pipeline_config, seed_prepared

pytest_plugins = ["report_fixtures"]


@pytest.fixture(scope="module")
def finished(finished_pipeline):
    """The session's complete run of the real workflow (2 trainings, validation, report).
    These tests only read it or dry-run against it."""
    return finished_pipeline


def scheduled_jobs(proc_stdout: str) -> dict:
    """Job counts from a dry run's 'Job stats' table."""
    table = proc_stdout.split("Job stats:")[1].split("Reasons:")[0] if "Job stats:" in proc_stdout else ""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


@pytest.mark.slow
def test_pipeline_produces_measured_stage1_report(finished):
    work, _ = finished
    results = work / "results"
    metrics = read_run_record(results / MACHINE / "ddp-full-w2-mb4-ga1" / "metrics.json").to_dict()
    assert metrics["as_built"]["world_size"] == 2 and metrics["status"] == "ok"
    assert metrics["timing"]["step_time_s"]["n"] == 6 and metrics["throughput"]["tokens_per_s"] > 0
    assert (results / MACHINE / "hardware.json").is_file()
    summary = (results / "summary.csv").read_text().splitlines()
    assert len(summary) == 3 and summary[0].startswith("machine,")
    html = (results / "report" / "index.html").read_text()
    assert "Stage 1" in html and "data:image/png;base64," in html
    readme = (results / "report" / "README.md").read_text()
    assert "**passed** (minimal)" in readme and "**passed** (bonus)" in readme


@pytest.mark.slow
def test_an_epochs_run_gets_its_steps_from_the_prepared_data_and_a_rerun_has_nothing_to_do(finished):
    work, _ = finished
    metrics = read_run_record(work / "results" / MACHINE / "ddp-full-w1-mb8-ga1" / "metrics.json").to_dict()
    length = metrics["spec"]["length"]
    # The corpus is the pydoc topics of the Python that runs the tests: its block count differs
    # between Python releases (6438 blocks of 32 tokens on 3.11.7, 6431 on 3.11.2).
    data = json.loads((work / "results" / "prep" / "data" / "default-seq32" / "distlab_data.json").read_text())
    blocks = data["splits"]["train"]["blocks"]
    steps = math.ceil(0.01 * (blocks // 8))  # epochs 0.01, 1 rank, micro-batch 8
    assert length["from"] == "epochs" and length["train_blocks"] == blocks and metrics["spec"]["steps"] == steps
    assert len(metrics["loss"]["per_step"]) == steps  # (the no-op rerun: test_nothing_to_do_on_a_rerun)


@pytest.mark.slow
def test_every_runs_curves_are_in_tensorboard_and_the_machines_mlflow_store(finished):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from distlab.runtime.tracking import mlflow_uri

    work, _ = finished
    client = MlflowClient(tracking_uri=mlflow_uri(work / "results" / MACHINE / "tracking"))
    (experiment,) = client.search_experiments(filter_string=f"name = 'distlab/{MACHINE}'")
    for name in ("ddp-full-w1-mb8-ga1", "ddp-full-w2-mb4-ga1"):
        run = work / "results" / MACHINE / name
        losses = read_run_record(run / "metrics.json").to_dict()["loss"]["per_step"]
        events = EventAccumulator(str(run / "run_files" / "tensorboard"))
        events.Reload()
        assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
        (logged,) = client.search_runs([experiment.experiment_id], f"tags.`distlab.experiment` = '{name}'")
        history = sorted(client.get_metric_history(logged.info.run_id, "train/loss"), key=lambda m: m.step)
        assert [m.value for m in history] == pytest.approx(losses, rel=1e-12) and logged.info.status == "FINISHED"


def local_paths(work) -> list[str]:
    """What results meant to be shared must not name: the working folder, the checkout, the home folder."""
    import os

    from conftest import REPO

    return [str(work.resolve()), str(REPO), os.path.expanduser("~")]


@pytest.mark.slow
def test_the_trackers_stores_name_no_local_path_user_or_host(finished):
    import getpass
    import socket
    import sqlite3

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    work, _ = finished
    paths, user, host = local_paths(work), getpass.getuser(), socket.gethostname()
    store = work / "results" / MACHINE / "tracking" / "mlflow.db"
    assert not [p for p in paths if p.encode() in store.read_bytes()]
    with sqlite3.connect(store) as db:  # every text the store holds, table by table
        tables = [row[0] for row in db.execute("select name from sqlite_master where type = 'table'")]
        cells = [(t, v) for t in tables for row in db.execute(f"select * from '{t}'") for v in row if isinstance(v,
                                                                                                                 str)]
        tags = dict(db.execute("select key, value from tags"))
    assert {t: v for t, v in cells if v == user or re.search(rf"\b{re.escape(host)}\b", v)} == {}
    assert tags["mlflow.user"] == tags["mlflow.source.name"] == "distlab"
    assert {v for t, v in cells if t == "experiments" and ":/" in v} == {"mlflow-artifacts:/0",
                                                                         f"mlflow-artifacts:/distlab/{MACHINE}"}
    events = list((work / "results" / MACHINE).glob("*/run_files/tensorboard/*tfevents*"))
    assert len(events) == 2
    for path in events:
        text = "".join(str(event) for event in EventFileLoader(str(path)).Load())
        assert "hparams" in text and not [p for p in paths if p in text or p.encode() in path.read_bytes()]
        assert not re.search(rf"\b{re.escape(host)}\b", path.name + text)


@pytest.mark.slow
def test_what_distlab_writes_into_the_logs_names_no_local_absolute_path(finished):
    work, _ = finished
    paths = local_paths(work)
    launches, leaks = [], []
    for log in (work / "results").rglob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            launch = line.startswith("$ ")
            launches += [line] if launch else []
            # Libraries' own warnings point into their installed sources: left as they print them.
            if any(p in line for p in paths) and (launch or "site-packages/" not in line):
                leaks.append(f"{log.relative_to(work)}: {line}")
    assert len(launches) >= 2  # the collective benchmark's and each validation's launch lines
    assert leaks == []


@pytest.mark.slow
def test_a_runs_cpu_ranks_start_warm_and_its_servers_end_with_it(finished):
    """snakemake's onstart server (distlab.launchers.warm_start): every CPU rank of the run was
    forked from it, and neither it nor its flavour servers outlive the run."""
    import psutil

    work, _ = finished
    starts = {path.parent.name: read_run_record(path).to_dict()["timeline"]["start"]
              for path in (work / "results" / MACHINE).glob("*/metrics.json")}
    assert len(starts) == 2 and all(start.startswith("forked from the run's warm interpreter")
                                    for start in starts.values()), starts
    log = (work / "results" / "logs" / "warm-start.log").read_text()
    pids = [int(pid) for pid in re.findall(r"^warm start (?:flavour )?server (\d+):", log, re.M)]
    assert pids and "imported torch" in log, log

    def a_server(pid):
        try:
            return "distlab.launchers.warm_server" in " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            return False

    assert not [pid for pid in pids if a_server(pid)]


@pytest.mark.slow
def test_benchmark_and_log_recorded_for_training_jobs(finished):
    run = finished[0] / "results" / MACHINE / "ddp-full-w1-mb8-ga1"
    assert (run / "benchmark.tsv").read_text().startswith("s\t")
    assert (run / "train.log").is_file()


@pytest.mark.slow
def test_nothing_to_do_on_a_rerun(finished):
    work, cfg = finished
    proc = snakemake(work, "--cores", "2", "-n", config=cfg)
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_changing_one_experiment_reruns_only_it(finished):
    work, cfg = finished
    changed = copy.deepcopy(cfg)
    changed["stages"]["ddp"]["experiments"][1]["lr"] = 1e-3
    proc = snakemake(work, "--cores", "2", "-n", config=changed)
    jobs = scheduled_jobs(proc.stdout)
    assert jobs.get("train") == 1, proc.stdout
    assert "experiment=ddp-full-w2-mb4-ga1" in proc.stdout
    assert "experiment=ddp-full-w1-mb8-ga1" not in proc.stdout
    assert not {"prepare_data", "train_tokenizer", "build_base_model", "hardware"} & set(jobs)


@pytest.mark.slow
def test_bad_config_stops_before_any_job_and_leaves_results_untouched(finished):
    work, cfg = finished
    before = {p: p.stat().st_mtime_ns for p in (work / "results").rglob("*") if p.is_file()}
    bad = copy.deepcopy(cfg)
    bad["stages"]["ddp"]["experiments"][0]["world_size"] = 0
    proc = snakemake(work, "--cores", "2", config=bad, check=False)
    assert proc.returncode != 0
    assert "stages.ddp.experiments.0.world_size" in proc.stdout + proc.stderr
    after = {p: p.stat().st_mtime_ns for p in (work / "results").rglob("*") if p.is_file()}
    assert before == after


def test_workflow_passes_snakemakes_linter(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config(STAGES)))
    proc = snakemake(tmp_path, "--lint", "--configfile", str(tmp_path / "c.yaml"), check=False)
    assert "Congratulations" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_seeded_workspace_leaves_the_workflow_no_data_to_prepare(prepared, tmp_path):
    """The shared pipeline fixture seeds the session's tokenizer, data and model where the
    workflow reads them (report_fixtures.seed_prepared): its run pays for no prep job."""
    seed_prepared(prepared, tmp_path)
    proc = snakemake(tmp_path, "-n", config=pipeline_config())
    jobs = scheduled_jobs(proc.stdout)
    assert jobs.get("train") == 2, proc.stdout  # the plan is the pipeline's
    assert not {"prepare_data", "train_tokenizer", "build_base_model", "hardware"} & set(jobs), proc.stdout


def test_a_config_file_on_the_command_line_replaces_the_embedded_default(tmp_path, monkeypatch):
    import shutil

    from conftest import REPO

    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    monkeypatch.setenv("DISTLAB_GPU_COUNT", "1")
    gpu = snakemake(tmp_path, "-n", "--configfile", str(REPO / "config" / "gpu_check.yaml"))
    assert scheduled_jobs(gpu.stdout)["train"] == 4  # the GPU kit's experiments only, no default stage
    monkeypatch.setenv("DISTLAB_GPU_COUNT", "0")
    default = snakemake(tmp_path, "-n", "--config", "machine=other")
    assert scheduled_jobs(default.stdout)["train"] >= 20  # --config edits the default, which still applies


@pytest.mark.slow
def test_delete_all_output_leaves_nothing_of_a_run_but_its_logs(finished, tmp_path):
    import shutil

    from distlab.configuration.config import load

    work, cfg = finished
    copy_dir = tmp_path / "work"
    shutil.copytree(work, copy_dir, symlinks=True)
    # Runs that write side files: the generated accelerate config, the pipeline's per-rank records.
    cfg = copy.deepcopy(cfg)
    cfg["stages"]["accelerate"] = {"experiments": [{"strategy": "accelerate", "world_size": 1, "micro_batch": 4}]}
    cfg["stages"]["parallel"] = {"experiments": [{"strategy": "pp", "world_size": 2}]}
    _, specs = load(copy.deepcopy(cfg), gpu_count=0)
    side = [i for i, s in specs.items() if s["stage"] in ("accelerate", "parallel")]
    snakemake(copy_dir, "--cores", "2", *[f"results/{MACHINE}/{i}/metrics.json" for i in side], config=cfg)
    results = copy_dir / "results"
    written = {p.name for i in side for p in (results / MACHINE / i).rglob("*")}
    assert {"accelerate_config.yaml", "pipeline-rank0.json", "pipeline-rank1.json"} <= written, written
    snakemake(copy_dir, "--delete-all-output", "--cores", "1", config=cfg)
    logs = {".log", ".tsv"}  # Snakemake keeps logs and benchmarks by design
    # ...and the machine's MLflow store, which every job adds its run to (distlab/runtime/tracking.py).
    shared = {"tracking/mlflow.db", "tracking/mlflow.lock"}
    left = sorted(str(p.relative_to(results)) for p in (results / MACHINE).rglob("*")
                  if p.is_file() and p.suffix not in logs and str(p.relative_to(results / MACHINE)) not in shared)
    assert left == [], left
    assert not (results / "summary.csv").exists()
    assert not [p for p in (results / "report").rglob("*") if p.is_file()]  # empty folders may stay
    assert not (results / "summary-rejected.json").exists()


@pytest.mark.slow
def test_a_failed_checkpoint_validation_fails_the_workflow_after_the_report_is_built(finished, tmp_path):
    import shutil

    work, cfg = finished
    copy = tmp_path / "work"
    shutil.copytree(work, copy, symlinks=True)
    run = copy / "results" / MACHINE / "ddp-full-w1-mb8-ga1"
    validation = json.loads((run / "validation.json").read_text())
    validation.update(status="failed", passed=False, reason="reload failed (edited by the test)")
    (run / "validation.json").write_text(json.dumps(validation))
    proc = snakemake(copy, "--cores", "2", config=cfg, check=False)
    assert proc.returncode != 0
    assert "reload failed (edited by the test)" in (copy / "results" / "logs" / "check_validations.log").read_text()
    report = copy / "results" / "report" / "index.html"
    assert report.stat().st_mtime > (run / "validation.json").stat().st_mtime  # rebuilt, after the edit
    lines = (copy / "results" / "summary.csv").read_text().splitlines()
    column = lines[0].split(",").index("experiment")
    summary = {r.split(",")[column]: r for r in lines[1:]}
    assert ",failed," in summary["ddp-full-w1-mb8-ga1"]  # the column comes from the declared validation.json


def test_every_rule_that_runs_a_job_declares_its_memory_and_runtime():
    from conftest import REPO

    missing = []
    for path in sorted((REPO / "rules").glob("*.smk")):
        for block in re.split(r"^rule ", path.read_text(), flags=re.M)[1:]:
            name = block.split(":")[0]
            if "mem_mb=" not in block or "runtime=" not in block:
                missing.append(f"{path.name}: {name}")
    assert missing == []
