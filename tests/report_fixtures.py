"""One real, tiny workflow run shared by the report, merge and browser tests (a pytest
plugin, so the session-scoped fixture runs once however many modules use it).

To save the minute data prep costs, the session's `prepared` tokenizer, data, model and
hardware.json are copied where the workflow expects them; Snakemake then runs the rest
for real: two trainings, the collective benchmark, the advisor, the summary, the report.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import seed_hardware, snakemake, tiny_config
from distlab.testing import workflow_data_dirs

MACHINE = "testbox"  # the machine tag of the `prepared` hardware.json
# The 1-rank run's length is in epochs (0.01 of the 6438 train blocks: 804 micro-batches of 8
# per epoch -> 9 steps), resolved by its launch; both runs feed the trackers.
STAGES = {"ddp": {"experiments": [{"world_size": 1, "micro_batch": 8, "epochs": 0.01},
                                  {"world_size": 2, "micro_batch": 4, "repeats": 2}]}}


def pipeline_config() -> dict:
    cfg = tiny_config(STAGES, machine=MACHINE,
                      collectives={"min_bytes": 1024, "max_bytes_cpu": 262144, "iters": 4, "warmup": 1})
    cfg["defaults"].update(steps=8, untimed_steps=2, tracking=["tensorboard", "mlflow"])
    return cfg


def seed_prepared(prepared: Path, work: Path, cfg: dict | None = None) -> None:
    """The session's tokenizer, model, hardware.json and seq-32 data where the workflow run on
    `cfg` (the pipeline's by default) reads them, so that it schedules none of their jobs."""
    prep = work / "results" / "prep"
    shutil.copytree(prepared / "tokenizer", prep / "tokenizer")
    for data_dir in workflow_data_dirs(cfg or pipeline_config(), prep):
        assert data_dir.name.endswith("-seq32"), f"{data_dir}: only seq 32 is prepared"
        shutil.copytree(prepared / "data32", data_dir)
    shutil.copytree(prepared / "model", prep / "model")
    seed_hardware(prepared, work, MACHINE)


@pytest.fixture(scope="session")
def finished_pipeline(prepared, tmp_path_factory):
    """(workdir, config) of a completed `snakemake --cores 2` run; tests copy it before changing it."""
    work = tmp_path_factory.mktemp("report-pipeline")
    seed_prepared(prepared, work)
    cfg = pipeline_config()
    snakemake(work, "--cores", "2", config=cfg)
    return work, cfg
