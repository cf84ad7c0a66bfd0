"""Tasks: what is trained, beside the strategy (how it is distributed). The task `<name>` is
the `TASK` object of distlab/tasks/<name with - as _>.py, imported only when asked for;
config/schema.yaml's task enum is the list of names a config may use. A task owns its model
building and loading, its data and batches, its loss, its held-out evaluation, its export
and its report card; strategies, the training loop and the launchers call it through
distlab.tasks.base.Task and never ask which task they run (ARCHITECTURE.md, how to add a task).

Task modules import torch and their libraries inside methods only: the Snakefile imports
them at parse time (config checks, rule paths)."""
from __future__ import annotations

from distlab.registry import load
from distlab.configuration.schema import task_enum

DEFAULT_TASK = "causal-lm"


def task_names() -> list[str]:
    """The task enum of config/schema.yaml (read through distlab.configuration.schema, not distlab.configuration.config:
    distlab.configuration.config asks this package for each experiment's task)."""
    return task_enum()


def task_named(name: str):
    return load({known: f"distlab.tasks.{known.replace('-', '_')}:TASK" for known in task_names()}, name, "task")


def task_for(spec: dict):
    """The task of a spec (specs written before tasks existed are causal LMs)."""
    return task_named(spec.get("task", DEFAULT_TASK))
