"""Where a run's side files lie: the configs a launch generates and the records ranks write
beside metrics.json go in <run_dir>/run_files/, one declared output of rule train."""
from __future__ import annotations

import os
from pathlib import Path

RUN_FILES = "run_files"  # accelerate_config.yaml, deepspeed_config*.json, pipeline-rank<r>.json


def run_files_dir(run_dir: str | os.PathLike) -> Path:
    """<run_dir>/run_files (for a checkpoint-validation launch, run_dir is its work folder)."""
    return Path(run_dir) / RUN_FILES

# What the summary and the report read beside a run's metrics.json (distlab.report.collect.load_run):
# rule train writes them all but validation.json (rule validate_checkpoint, when validation.scope
# selects the run); benchmark.tsv is train's `benchmark:` record.
RUN_SIDE_FILES = ("steps.jsonl", "validation.json", "devices.json", "benchmark.tsv", RUN_FILES)
# What the report reads in a run's machine folder and in its results folder (distlab.report.build).
MACHINE_FILES = ("hardware.json", "collectives.json", "advice.json", "advice-sd.json")
KUBERAY_CHECKS = "kuberay/checks.json"
