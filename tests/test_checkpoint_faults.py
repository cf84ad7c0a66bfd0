"""Crash recovery for real: a rank killed with SIGKILL mid-run fails its Snakemake job
cleanly, and the next `snakemake --rerun-incomplete` resumes from the last complete
checkpoint, ending on the same losses as a run that was never interrupted."""
import json
import os

import pytest

from conftest import snakemake, tiny_config
from distlab.checkpoint import FAULT_ENV
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
    resumed = json.loads((results / KILLED / "metrics.json").read_text())
    reference = json.loads((results / REFERENCE / "metrics.json").read_text())
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
