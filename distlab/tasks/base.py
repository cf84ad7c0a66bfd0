"""The one rank-time interface every task implements (distlab/tasks/<name>.py); strategies, the
training loop, the worker, checkpoints and validation call only these.

A task's `TASK` is an instance of a class that subclasses both its parse-time declaration
(distlab/configuration/tasks/<name>.py: resolve a spec, refuse what the task cannot run naming the
field or file, name the files a job reads; no torch) and `Task` here, whose rank-time methods it
implements: load the trained module (whole, on meta for FSDP, partitioned for ZeRO-3), apply LoRA,
build batches, compute the loss, count FLOPs, evaluate, export and check the export.

The trained module is what a strategy wraps (the causal LM; the Stable Diffusion UNet). Whatever
else a task needs per rank (a frozen VAE and text encoder) lives in its data object, built by
`train_data` and never handed to a strategy.
"""
from __future__ import annotations

import importlib

from distlab.configuration.tasks.declaration import TaskDeclaration
from distlab.records.job import Job
from distlab.records.spec import Spec


def lazy(target: str):
    """A Task method that hands its arguments to `module:function`, imported on first call (a task
    module stays light: what a method needs is imported when a rank first calls it)."""
    module, name = target.split(":")

    def call(self, *args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__doc__ = f"{target} (imported when first called)"
    return call


class TrainData:
    """What the loop draws micro-batches from: `len()` samples, `batch(indices, device, step)`
    returns the dict the task's `loss` takes, `describe()` says what was built (as_built.task)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, indices: list[int], device, step: int) -> dict:
        raise NotImplementedError

    def describe(self) -> dict:
        return {}


class Task(TaskDeclaration):
    """The rank-time half of a task; its parse-time half (name, unit, lacks, the config checks and
    paths) is inherited from its declaration."""

    def import_code(self, source: str, lora: bool) -> None:
        """Import the modeling libraries before the RSS baseline is read (distlab.runtime.memory)."""

    def load_model(self, source: str, dtype=None, device: str | None = None):
        """The trained module, whole (device None) or on the meta device (device "meta")."""
        raise NotImplementedError

    def weights_folder(self, source: str) -> str:
        """The folder whose *.safetensors hold the trained module's weights (FSDP's sharded load)."""
        return str(source)

    def hidden_size(self, source: str) -> int | None:
        """The trained module's hidden size, read before it is built (ZeRO-3's "auto" sizes);
        None: the task has none (DeepSpeed's own sizes then)."""
        return None

    def load_partitioned(self, source: str, ds_config: dict, dtype, nvme_params: bool, zero) -> tuple:
        """(module, load report): the trained module built under deepspeed.zero.Init (ZeRO-3).
        `zero`: the strategy's ZeRO-3 loader (distlab.strategies.deepspeed_load: zero_init,
        check_built_dtype, load_partitioned), handed in so that a task names no strategy."""
        raise NotImplementedError

    def apply_lora(self, model, spec: Spec) -> tuple:
        """(model, adapted module names); only adapter weights train."""
        raise NotImplementedError

    def flops(self, model, spec: Spec, count: bool) -> dict:
        """FLOPs per unit of the module as trained: `flops_per_<unit>` is what MFU uses."""
        raise NotImplementedError

    def train_data(self, job: Job, spec: Spec, device, split: str = "train") -> TrainData:
        raise NotImplementedError

    def loss(self, model, batch: dict, num_items=None):
        """The micro-batch's loss, from the (possibly wrapped) trained module; autograd on.
        num_items None: its mean over the micro-batch's items; else its summed loss over
        num_items, the step's item count (distlab.runtime.accumulation)."""
        raise NotImplementedError

    def loss_items(self, batch: dict) -> int:
        """How many items (label tokens, images) of this micro-batch the loss averages over."""
        raise NotImplementedError

    def data_facts(self, job: Job, records_by_rank: list, ranks_per_replica: int) -> dict:
        """metrics.json's data_prep block: what the prepared data is and what this run read."""
        return {}

    # -- held-out evaluation, export, checks (collective: every rank calls them) ---------------
    def evaluate_trained(self, strategy, job: Job) -> dict | None:
        """The trained model's held-out figure, on the same data as the task's rule that
        evaluates the base model (job.base_eval_json): the record on rank 0, None elsewhere."""
        raise NotImplementedError

    def export_pass(self, strategy, job: Job, spec: Spec, folder) -> tuple:
        """The final save's export into `folder`/export and the trained state's output on the
        task's fixed batch into `folder`/eval_logits.safetensors (`logits`), compared later by
        reload, reshard, resume and export checks. (info on rank 0, rank 0's error or None)."""
        raise NotImplementedError

    def trained_outputs(self, validator, strategy) -> tuple:
        """Validation: (a plain model or None, the strategy's state's output on the fixed batch)
        on rank 0, (None, None) elsewhere."""
        raise NotImplementedError

    def check_export(self, validator) -> dict:
        """Rank 0 of checkpoint validation: load the export as a user would and compare."""
        raise NotImplementedError

    def lora_base_frozen(self, model, source: str, meta: dict, base: dict | None, reload_diff: float) -> dict:
        """After a LoRA reload: the frozen base is the one the checkpoint names and unchanged
        (`model`: trained_outputs' plain model; `base`: checkpoint.base_identity of `source`)."""
        raise NotImplementedError
