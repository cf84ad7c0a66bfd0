"""config/schema.yaml, parsed once per process, file version and set of axis names, with its
`enum_from` enums filled from the axes' declarations (distlab.configuration.axes): the file
lists no strategy, task, launcher, stage, precision, method, device or sampler by hand, and
each strategy's `<name>:` block is the `schema` of its settings (distlab/configuration/strategies/<name>_settings.py).
Torch-free and light: the Snakefile imports it at parse time."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

from distlab.configuration import axes

SCHEMA_PATH = Path(__file__).resolve().parent.parent.parent / "config" / "schema.yaml"


def load_schema() -> dict:
    """config/schema.yaml (a copy: callers may change theirs)."""
    return copy.deepcopy(schema_read_only())


def schema_read_only() -> dict:
    """config/schema.yaml, parsed once per process and file version, shared: never change it.
    Expanding the default config asks for it ~170 times (each experiment's task names), which
    cost 8 s of YAML parsing in every `snakemake` call and test, then 0.07 s of copies."""
    path = Path(SCHEMA_PATH)
    return _parsed_schema(str(path), path.stat().st_mtime_ns, axes.frozen_names())


@functools.lru_cache(maxsize=4)
def _parsed_schema(path: str, version: int, names: tuple) -> dict:
    with open(path) as fh:
        schema = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built
    axes.fill_enums(schema, dict(names))
    from distlab.configuration.strategies.settings import registered

    experiment = schema["$defs"]["experiment"]["properties"]
    for name, settings in registered().items():  # each strategy's own block, typed in its settings file
        if settings.schema is not None:
            experiment[name] = copy.deepcopy(settings.schema)
    return schema
