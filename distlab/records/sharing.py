"""Results meant to be shared between machines (results/<machine>/, copied or listed under
extra_results) carry what was measured, not who measured it where:

- files and folders distlab's processes write are not world-readable: every process it starts
  (the Snakemake process, each job's script, each rank, each Ray worker) runs under
  RESULTS_UMASK (owner: all; group: read; others: nothing);
- with `machine:` set, no file names this host (hardware.json keeps `hostname` only when the
  tag itself is derived from it), nor TensorBoard's event file names;
- paths of the checkout, the working folder and the home folder are written relative to them
  (portable) in metrics.json, job.json, the Accelerate config's rerun line, the MLflow store and
  TensorBoard's hparams (distlab.runtime.tracking), and in what distlab itself writes into logs: `$ ...`
  launch lines, its messages, logging records and failure tracebacks (distlab.jobs.rule_log). What
  libraries and child processes print into a log stays as they print it;
- Ray nodes are named by host label, never by address (distlab.launchers.ray_record).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# Owner read/write, group read, others nothing (directories: group may list and enter them).
RESULTS_UMASK = 0o027
# The checkout distlab runs from (the repository root).
PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent


def private_files() -> None:
    """This process and its children create files no other user of the machine can read."""
    os.umask(RESULTS_UMASK)



def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, what replaces it): the working folder and the checkout become relative
    paths (the workflow runs there: results/... reads the same from the repository), then the
    home folder becomes '~/'. Longest first, so a checkout inside the home folder is relative."""
    roots = {os.getcwd(), str(PROJECT_ROOT)}
    found = [(root.rstrip("/") + "/", "") for root in roots if len(root.rstrip("/")) > 1]
    home = os.path.expanduser("~").rstrip("/")
    if len(home) > 1:
        found.append((home + "/", "~/"))
    return sorted(found, key=lambda pair: -len(pair[0]))


def portable(value, prefixes: list[tuple[str, str]] | None = None):
    """`value` (JSON-like: dicts, lists, strings) with the absolute paths of this checkout, the
    working folder and the home folder written relative to them (home: '~/'), wherever in a
    string they appear (a sqlite:/// URI, a command line)."""
    prefixes = _prefixes() if prefixes is None else prefixes
    if isinstance(value, str):
        for prefix, replacement in prefixes:  # where a path starts, not inside another path
            value = re.sub(r"(?<![\w.-])" + re.escape(prefix), replacement, value)
        return value
    if isinstance(value, dict):
        return {key: portable(item, prefixes) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item, prefixes) for item in value]
    return value
