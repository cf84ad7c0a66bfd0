"""Crash recovery for real: a rank killed with SIGKILL mid-run fails its Snakemake job
cleanly, and the next `snakemake --rerun-incomplete` resumes from the last complete
checkpoint, ending on the same losses as a run that was never interrupted."""
import json
import os

import pytest

from conftest import snakemake, tiny_config
from distlab.checkpoints.checkpoint import FAULT_ENV
from distlab.records.job import Job
from distlab.records.run_outputs import read_run_record
from report_fixtures import MACHINE, seed_prepared

KILLED = "ddp-full-w2-mb4-ga1"
REFERENCE = "ddp-full-w2-mb4-ga1-ref"


@pytest.mark.slow
def test_killed_rank_fails_the_job_and_the_rerun_resumes_to_the_same_losses(prepared, tmp_path):
    work = tmp_path / "work"
    seed_prepared(prepared, work)
    # Mid-schedule: warm-up over the first 2 steps, then cosine decay; the kill falls inside it.
    tuned = {"lr_schedule": "cosine", "lr_warmup_steps": 2, "max_grad_norm": 1.0}
    experiments = [{"world_size": 2, "micro_batch": 4, "checkpoint_every": 2, **tuned},
                   {"world_size": 2, "micro_batch": 4, "checkpoint_every": 2, "tag": "ref", **tuned}]
    cfg = tiny_config({"ddp": {"experiments": experiments}}, machine=MACHINE)
    results = work / "results" / MACHINE
    targets = [f"results/{MACHINE}/{exp}/metrics.json" for exp in (KILLED, REFERENCE)]

    # Rank 1 dies right after step 3 (steps 2 and 4 are checkpoint steps): torchrun tears the
    # group down, the job fails within the timeout instead of hanging in a collective.
    os.environ[FAULT_ENV] = f"{KILLED}:1:3"
    try:
        crashed = snakemake(work, "--cores", "2", "--keep-going", *targets, config=cfg, check=False, timeout=400)
    finally:
        del os.environ[FAULT_ENV]
    assert crashed.returncode != 0
    assert not (results / KILLED / "metrics.json").exists()
    assert f"{FAULT_ENV}: killing rank 1 after step 3" in (results / KILLED / "train.log").read_text()
    # The crash-recovery checkpoint survived Snakemake's cleanup of the failed job's outputs.
    assert (results / KILLED / "resume" / "step-000002" / "MANIFEST.json").is_file()

    snakemake(work, "--cores", "2", "--rerun-incomplete", *targets, config=cfg, timeout=400)
    resumed = read_run_record(results / KILLED / "metrics.json").to_dict()
    reference = read_run_record(results / REFERENCE / "metrics.json").to_dict()
    assert resumed["checkpoint"]["resumed_from_steps"] == 2
    assert reference["checkpoint"]["resumed_from_steps"] is None
    assert len(resumed["loss"]["per_step"]) == len(reference["loss"]["per_step"]) == 6
    for a, b in zip(resumed["loss"]["per_step"], reference["loss"]["per_step"]):
        assert abs(a - b) <= 1e-6, (resumed["loss"]["per_step"], reference["loss"]["per_step"])
    # Same data too: every step read the same samples on every rank.
    steps = [json.loads(line) for line in (results / KILLED / "steps.jsonl").read_text().splitlines()]
    ref_steps = [json.loads(line) for line in (results / REFERENCE / "steps.jsonl").read_text().splitlines()]
    assert [s["samples_by_rank"] for s in steps] == [s["samples_by_rank"] for s in ref_steps]
    # The LR schedule resumed where it stood: the same rates, and the same pre-clip norms.
    assert [s["lr"] for s in steps] == [s["lr"] for s in ref_steps] and len({s["lr"] for s in steps}) > 3
    assert [s["grad_norm"] for s in steps] == pytest.approx([s["grad_norm"] for s in ref_steps], rel=1e-6)
    assert (results / KILLED / "checkpoint" / "final" / "MANIFEST.json").is_file()
    assert not (results / KILLED / "resume").exists()


@pytest.mark.slow
def test_a_failed_final_save_keeps_the_runs_figures_and_counts_it_trained_but_unsaved(prepared, tmp_path,
                                                                                   monkeypatch):
    """Rank 0's export raises at the final save of a 2-rank run: the other rank is not left in a
    collective, the job ends ok with every output rule train declares, and metrics.json keeps
    the figures (written before the save) with checkpoint.status failed and the error."""
    from conftest import load_filed, resolve, run_experiment
    from distlab.checkpoints.export import SAVE_FAULT_ENV
    from distlab.report.cards.checkpoint_table import checkpoint_card
    from distlab.report.summary_table import summary_row
    from distlab.jobs.validate import validate_run

    spec = resolve({"world_size": 2, "micro_batch": 4}, steps=4, untimed_steps=1)
    monkeypatch.setenv(SAVE_FAULT_ENV, spec["id"])
    run = tmp_path / "run"
    metrics = run_experiment(prepared, run, spec)
    assert metrics["status"] == "ok"
    for figure in ("timing", "throughput", "memory", "eval", "loss"):
        assert metrics[figure], figure
    assert metrics["eval"]["trained"]["loss"] > 0
    saved = metrics["checkpoint"]
    assert saved["status"] == "failed" and f"rank 0: RuntimeError: {SAVE_FAULT_ENV}" in saved["error"]
    # What rule train declares is there (so Snakemake keeps it); no half-written checkpoint is.
    for name in ("metrics.json", "steps.jsonl", "devices.json", "job.json", "run_files", "checkpoint/FAILED.json"):
        assert (run / name).exists(), name
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["FAILED.json"]
    result = validate_run(run, str(prepared / "model"), str(prepared / "data32"), run / "validation.json")
    assert result["status"] == "nothing to validate" and not result["passed"]
    assert "final save failed" in result["reason"] and SAVE_FAULT_ENV in result["reason"]
    loaded = load_filed(run, tmp_path / "filed")
    assert summary_row(loaded)["status"] == "ok" and summary_row(loaded)["checkpoint"] == "failed"
    (goal,) = [g for g in checkpoint_card([loaded]).goals if "saved its checkpoint" in g.text]
    assert goal.status == "failed" and spec["id"] in goal.evidence


@pytest.mark.slow
def test_a_run_that_dies_out_of_memory_in_its_final_save_had_written_its_figures(prepared, tmp_path, monkeypatch):
    """Rank 0 ends in the save as the memory watchdog ends it: metrics.json, written before the
    save, keeps the trained run's figures under status oom."""
    from conftest import resolve
    from distlab.checkpoints.export import SAVE_FAULT_ENV
    from distlab.jobs.launch import launch

    spec = resolve({"world_size": 1, "micro_batch": 4}, steps=3, untimed_steps=1)
    monkeypatch.setenv(SAVE_FAULT_ENV, f"{spec['id']}:oom")
    run = tmp_path / "run"
    job = Job(spec=spec, run_dir=str(run), data_dir=str(prepared / "data32"),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=str(run / "checkpoint"))
    assert launch(job, log_path=str(run / "train.log"), timeout=300) == "oom"
    metrics = read_run_record(run / "metrics.json").to_dict()
    assert metrics["status"] == "oom" and metrics["oom_phase"] == "final save"
    assert metrics["throughput"]["tokens_per_s"] > 0 and metrics["eval"]["trained"]["loss"] > 0
    assert metrics["checkpoint"]["status"] == "failed" and "injected out-of-memory" in metrics["checkpoint"]["error"]
