"""Tasks: what is trained, beside the strategy (how it is distributed). The task `<name>` is
the `TASK` object of distlab/tasks/<name with - as _>.py (or a package of that name), imported
only when asked for; those modules are the list of tasks (config/schema.yaml's task enum is
filled from it: distlab.configuration.axes). A task owns its model building and loading, its
data and batches, its loss, its held-out evaluation, its export and its report card;
strategies, the training loop and the launchers call it through distlab.tasks.base.Task and
never ask which task they run (ARCHITECTURE.md, how to add a task).

Task modules import torch and their libraries inside methods only: the Snakefile imports
them at parse time (config checks, rule paths)."""
from __future__ import annotations

import functools
import importlib
import pkgutil

from distlab.records.spec import SpecFields
from distlab.records.run_outputs import DEFAULT_TASK, task_of  # noqa: F401  (DEFAULT_TASK re-exported)
from distlab.registry import load

NOT_TASKS = ("base",)  # the interface, not a task


def task_names() -> list[str]:
    """Every task with a module in this package, by module name."""
    return list(_discover(tuple(__path__)))


@functools.lru_cache(maxsize=4)
def _discover(path: tuple[str, ...]) -> dict[str, str]:
    """{task name: "module:TASK"} of every module of the package that holds a TASK."""
    found = {}
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in NOT_TASKS:
            continue
        module = f"{__name__}.{info.name}"
        task = getattr(importlib.import_module(module), "TASK", None)
        if task is None:
            continue
        if task.name.replace("-", "_") != info.name:
            raise ValueError(f"distlab/tasks/{info.name}: TASK.name is '{task.name}', its file names "
                             f"'{info.name.replace('_', '-')}'")
        found[task.name] = f"{module}:TASK"
    return found


def task_named(name: str):
    return load(_discover(tuple(__path__)), name, "task")


def task_for(spec: SpecFields):
    """The task of a spec (specs written before tasks existed are causal LMs)."""
    return task_named(task_of(spec))
