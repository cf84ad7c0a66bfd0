"""config/schema.yaml, parsed once per process and file version.

A module of its own so that both its readers import it and neither imports the other:
distlab.configuration.config validates every config against it and distlab.tasks reads its task enum
(the names a config may use), while distlab.configuration.config asks distlab.tasks for each experiment's
task. Torch-free and light: the Snakefile imports it at parse time."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parent.parent.parent / "config" / "schema.yaml"


def load_schema() -> dict:
    """config/schema.yaml (a copy: callers may change theirs)."""
    return copy.deepcopy(schema_read_only())


def schema_read_only() -> dict:
    """config/schema.yaml, parsed once per process and file version, shared: never change it.
    Expanding the default config asks for it ~170 times (each experiment's task names), which
    cost 8 s of YAML parsing in every `snakemake` call and test, then 0.07 s of copies."""
    path = Path(SCHEMA_PATH)
    return _parsed_schema(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed_schema(path: str, version: int) -> dict:
    with open(path) as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built


def task_enum() -> list[str]:
    """The experiment's task enum: every task name a config may use."""
    return list(schema_read_only()["$defs"]["experiment"]["properties"]["task"]["enum"])
