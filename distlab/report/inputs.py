"""The files a rule declared as its inputs, and the rule that the summary and the report read
no other: a Snakemake script passes `declared_inputs(snakemake.input)` to the readers in
distlab.report.collect, which read a file beside a run only when `readable` says so."""
from __future__ import annotations

import csv
import math
import os
from pathlib import Path


def declared_inputs(paths) -> frozenset[str]:
    """A rule's input files and folders (snakemake.input) as the `declared` the readers take."""
    return frozenset(os.path.abspath(p) for p in paths)


def readable(path: Path, declared: frozenset[str] | None) -> bool:
    """A file to read: present and, for a rule, one of its declared inputs or under a declared
    folder (declared None: any present file, for tools and tests)."""
    if not path.is_file():
        return False
    if declared is None:
        return True
    full = Path(os.path.abspath(path))
    return any(str(p) in declared for p in (full, *full.parents))


def job_wall_seconds(path: Path) -> float | None:
    """Wall time of the whole Snakemake job (its `benchmark:` record), None when it cannot be read."""
    try:
        with open(path) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        seconds = float(rows[0]["s"]) if rows else None
    except (OSError, ValueError, KeyError, TypeError, csv.Error):  # a copied-in file of another shape
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds > 0 else None
