"""Tasks: what is trained, beside the strategy (how it is distributed). The task `<name>` is
the `TASK` object of distlab/tasks/<name with - as _>.py (or a package of that name), imported
only when a rank asks for it; its parse-time half is declared a layer down, in
distlab/configuration/tasks/<same name> (the declarations are the list of tasks: the config,
the rules and config/schema.yaml's task enum read them, never this package). A task owns its
model building and loading, its data and batches, its loss, its held-out evaluation, its export
and its report card; strategies, the training loop and the launchers call it through
distlab.tasks.base.Task and never ask which task they run (ARCHITECTURE.md, how to add a task).

A rank finds its task here and hands it to its strategy (distlab.strategies.base.RunContext.task):
a strategy names no task."""
from __future__ import annotations

from distlab.configuration.tasks.declaration import declaration_named, task_names, task_of
from distlab.records.spec import SpecFields
from distlab.registry import load


def task_named(name: str):
    """The rank-time task `name`: distlab/tasks/<name with - as _>'s TASK, imported now."""
    task = load({known: f"{__name__}.{known.replace('-', '_')}:TASK" for known in task_names()}, name, "task")
    declaration = type(declaration_named(name))
    if not isinstance(task, declaration):  # one task: its rank-time half inherits its declaration
        raise TypeError(f"distlab/tasks/{name.replace('-', '_')}: TASK is a {type(task).__name__}, not a "
                        f"{declaration.__name__} (its declaration)")
    return task


def task_for(spec: SpecFields):
    """The task of a spec (specs written before tasks existed are causal LMs)."""
    return task_named(task_of(spec))
