"""What the config layer knows of a task at parse time, without importing torch: the base class
every task's declaration subclasses, and the registry of tasks.

Each task `<name>` declares itself in distlab/configuration/tasks/<name with - as _>.py (or a
package of that name) as `DECLARATION = <TaskDeclaration subclass instance>`: how it resolves a
spec, refuses what it cannot run naming the field or file, and names the files a job reads. Its
rank-time half (model, data, loss, evaluation, export) is the `TASK` of distlab/tasks/<name>.py,
a subclass of this declaration and of distlab.tasks.base.Task. The declarations are the list of
tasks: the Snakefile's config expansion (distlab.configuration.config), rules/common.smk's paths,
config/schema.yaml's task enum (distlab.configuration.axes) and a rank's lookup
(distlab.tasks.task_named) read tasks through `task_names` here.
"""
from __future__ import annotations

import functools
import sys

from distlab.records.run_outputs import DEFAULT_TASK, task_of  # noqa: F401  (DEFAULT_TASK re-exported)
from distlab.records.spec import Spec, SpecDraft, SpecFields
from distlab.registry import discover

NOT_TASKS = ("declaration",)  # this module: the interface and the registry, not a task


class TaskDeclaration:
    """A task as the config sees it; subclasses override what theirs change."""

    name = "base"
    #: what throughput counts ("token": tokens/s; "image": images/s) and MFU is per
    unit = "sample"
    #: {trait: why}: what this task's model lacks that a strategy may need ("tensor_parallel_plan":
    #: a transformers base_model_tp_plan; "layer_stack": one stack of layers passing one hidden
    #: state, which pipeline stages cut; "nvme_parameter_offload": a ZeRO-3 load that can leave
    #: parameters on NVMe). Each strategy's settings say what it needs (needs_of_task, check_task),
    #: so no task names a strategy and no strategy names a task.
    lacks: dict[str, str] = {}
    #: Whether the advisor's memory formulas size this task's model (a decoder stack from its
    #: config.json): rank 0 then records their estimate for its run (distlab.rank.worker).
    advisor_sized: bool = False

    def id_part(self) -> str | None:
        """Appended to the experiment id (None: nothing, the default task)."""
        return None

    def resolve(self, spec: SpecDraft, config: dict) -> None:
        """Copy the task's settings a run depends on into the spec (its Snakemake params), in place."""

    def check_config(self, config: dict) -> None:
        """Checks of the task's own config block and files, before any experiment is expanded."""

    def check_experiment(self, spec: SpecFields, config: dict, fail) -> None:
        """fail(field, why) for an experiment this task cannot run."""

    def data_dir(self, spec: Spec, prep: str) -> str:
        """The prepared data folder a job of this spec reads (a Snakemake input)."""
        raise NotImplementedError

    def model_file(self, spec: Spec, config: dict, prep: str) -> str | None:
        """The file that stands for the model folder (a Snakemake input); its folder is loaded."""
        raise NotImplementedError

    def base_eval_path(self, spec: Spec, prep: str) -> str:
        """The base model's held-out evaluation of this spec's data (a Snakemake input)."""
        raise NotImplementedError

    def units_per_sample(self, spec: Spec) -> int:
        """Units (tokens, images) in one sample of a micro-batch."""
        return 1


def declared() -> dict[str, TaskDeclaration]:
    """{name: declaration} of every module of this package holding a DECLARATION (the package's
    search path, read from the package itself: Python imports it before any module in it)."""
    return _discover(tuple(sys.modules[__package__].__path__))


@functools.lru_cache(maxsize=4)
def _discover(path: tuple[str, ...]) -> dict[str, TaskDeclaration]:
    return discover(__package__, path, "DECLARATION", skip=NOT_TASKS)


def task_names() -> list[str]:
    """Every declared task, by name."""
    return list(declared())


def declaration_named(name: str) -> TaskDeclaration:
    try:
        return declared()[name]
    except KeyError:
        raise NotImplementedError(f"task '{name}' is not implemented in this version of distlab "
                                  f"(available: {sorted(declared())})") from None


def declaration_for(spec: SpecFields) -> TaskDeclaration:
    """The task of a spec (specs written before tasks existed are causal LMs)."""
    return declaration_named(task_of(spec))
