"""Where a run's side files lie: the configs a launch generates and the records ranks write
beside metrics.json go in <run_dir>/run_files/, one declared output of rule train."""
from __future__ import annotations

import os
from pathlib import Path

RUN_FILES = "run_files"  # accelerate_config.yaml, deepspeed_config*.json, pipeline-rank<r>.json


def run_files_dir(run_dir: str | os.PathLike) -> Path:
    """<run_dir>/run_files (for a checkpoint-validation launch, run_dir is its work folder)."""
    return Path(run_dir) / RUN_FILES
