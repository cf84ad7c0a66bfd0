"""The validation ranks (`python -m distlab.rank.validate_ranks --job job.json`, started by
distlab.jobs.validate under the experiment's launcher): build the strategy exactly as the worker
does, load checkpoints through the Strategy interface and record each check.

A launch runs its plan's phases in order: "same" (saved world size: compatibility, reload,
LoRA base weights, resume parity) and "reshard" (other world size). The export check runs
first, on rank 0, before this process loads anything else.

Every output compared here is computed the way the recorded ones were, by the task (causal
LM: distlab.tasks.causal_lm_outputs, on rank 0's CPU in fp32, the weights arriving one decoder
layer at a time): from a reloaded strategy's gathered state, or from the export's files. No
process holds a whole model.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

from distlab.records.spec import Spec
from distlab.configuration.training_tools import adapts
from distlab.records.job import ValidationJob, read_job
from distlab.records.validation import FAILED, PARITY_TOLERANCE, PASSED, RELOAD_TOLERANCE, UNSUPPORTED


class ValidationRank:
    """One validation rank: builds strategies like the worker does and records checks."""

    def __init__(self, job: ValidationJob):
        import torch
        import torch.distributed as dist

        from distlab.strategies import strategy_for
        from distlab.tasks import task_for
        from distlab.rank.worker import make_context

        self.job, self.spec = job, job.spec.replace(world_size=job.plan[0][1])
        if self.spec.device == "cpu":
            torch.set_num_threads(self.spec.cpu_threads_per_rank)
        self.ctx = make_context(job)
        self.ctx.spec = self.spec
        self.strategy_cls = strategy_for(self.spec)
        self.task = task_for(self.spec)
        self.strategy_cls(self.ctx).init_distributed()
        self.ctx.rank, self.ctx.world_size = dist.get_rank(), dist.get_world_size()
        self.rank = dist.get_rank()
        self.checks: dict = {}

    def shrink_to_one_rank(self) -> bool:
        """Leave the launched group; rank 0 goes on in a group of its own (True), others stop."""
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        if self.rank != 0:
            return False
        # Libraries that read the launcher's variables must see the new world too.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        cuda = self.ctx.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=self.ctx.device if cuda else None)
        self.ctx.world_size = 1
        return True

    def record(self, name: str, value: dict) -> None:
        self.checks[name] = value
        if self.rank == 0:
            Path(self.job.out).write_text(json.dumps(self.checks, indent=1, default=str))

    def guarded(self, name: str, check) -> bool:
        """Run one check; NotImplementedError = unsupported, CheckpointError = failed (every rank
        agrees on both). Anything else ends the ranks, so none waits forever in a collective."""
        from distlab.checkpoints.checkpoint import CheckpointError

        started = time.perf_counter()
        try:
            self.record(name, {**check(), "check_seconds": time.perf_counter() - started})
            return True
        except NotImplementedError as exc:
            self.record(name, {"status": UNSUPPORTED, "reason": str(exc)})
        except CheckpointError as exc:
            self.record(name, {"status": FAILED, "reason": str(exc)})
        except Exception as exc:
            self.record(name, {"status": FAILED, "reason": f"{type(exc).__name__}: {exc}", "exception": True})
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        return False

    def build(self, spec: Spec):
        """A fresh model + strategy exactly as the worker builds them; returns (strategy, signature)."""
        from distlab.rank.model_setup import prepare_model

        self.ctx.spec = spec
        strategy = self.strategy_cls(self.ctx)
        strategy.init_distributed()  # joins the existing group; some strategies set up their state here
        return strategy, prepare_model(strategy, self.job.model_source, spec).signature

    def trained_outputs(self, strategy):
        """Collective: (a plain model or None, the trained state's output on the task's fixed
        batch) on rank 0, (None, None) elsewhere (Task.trained_outputs; causal LM:
        streamed_outputs)."""
        return self.task.trained_outputs(self, strategy)

    def saved_logits(self, name: str = "logits"):
        from safetensors.torch import load_file

        return load_file(str(Path(self.job.final) / "eval_logits.safetensors"))[name]


def check_at_saved_world_size(validator: ValidationRank, world_size: int) -> None:
    """Reload, parity and resume checks in a group of the world size the run saved at."""
    import torch.distributed as dist

    from distlab.checkpoints import checkpoint as ckpt
    from distlab.rank.loop import IndexStream, gather, train

    job = validator.job
    spec = validator.spec = job.spec.replace(world_size=world_size)
    strategy, signature = validator.build(spec)
    meta = ckpt.read_meta(job.final)
    source = job.model_source  # LoRA: the frozen base's identity (collective), of the task's weight files
    base = ckpt.base_identity(source, validator.task.weights_folder(source)) if adapts(spec) else None

    def compatibility():
        ckpt.check_compatible(meta, spec, signature, job.final)
        ckpt.check_base(meta, base, job.final)
        return {"status": PASSED, "how": "model config, parameter shapes and experiment spec vs the checkpoint's"
                + ("; LoRA: the base model's weight files (sha256) vs those it names" if base else "")}

    if not validator.guarded("compatibility", compatibility):
        return

    def reload():
        info = ckpt.load_checkpoint(job.final, strategy, validator.ctx, signature, verify=False, base=base)
        model, logits = validator.trained_outputs(strategy)
        if validator.rank != 0:
            return {}
        diff = (logits - validator.saved_logits()).abs().max().item()
        if adapts(spec):
            validator.record("lora_base_frozen",
                             validator.task.lora_base_frozen(model, job.model_source, meta, base, diff))
        return {"status": PASSED if diff <= RELOAD_TOLERANCE else FAILED, "max_abs_logit_diff": diff,
                "tolerance": RELOAD_TOLERANCE, "world_size": dist.get_world_size(),
                "load_seconds": info["load_seconds"],
                "how": "fresh model + strategy, strategy.load_checkpoint; its output on the task's fixed batch "
                       "(causal LM: its state gathered one layer at a time and run on the CPU in fp32, logits of "
                       "the eval batch; text-to-image: the consolidated UNet's prediction on fixed held-out "
                       "inputs) vs the one recorded at save time"}

    validator.guarded("reload", reload)
    strategy = None  # the parity check builds its own; free this one first
    gc.collect()
    if not job.parity:
        validator.record("resume_parity", {"status": UNSUPPORTED, "reason": f"steps ({spec.steps}) <= "
                                       f"{ckpt.PARITY_STEPS}: no mid-run checkpoint to resume from"})
        return

    def resume_parity():
        strategy, signature = validator.build(spec)
        data = validator.task.train_data(job, spec, validator.ctx.device)
        stream = IndexStream(len(data), spec, strategy.data_parallel_rank, strategy.data_parallel_size,
                             getattr(strategy, "rank_batches", None))
        info = ckpt.load_checkpoint(job.parity, strategy, validator.ctx, signature, stream=stream, verify=False,
                                    base=base)
        start = info["steps_done"]
        records = gather(train(validator.ctx, strategy, data, start_step=start, stream=stream)["records"])
        _, logits = validator.trained_outputs(strategy)
        if validator.rank != 0:
            return {}
        losses = []
        for i in range(len(records[0])):
            values = [recs[i]["loss"] for recs in records if recs[i]["loss"] is not None]
            losses.append(sum(values) / len(values))
        expected = job.expected_losses[start:]
        loss_diff = max(abs(a - b) for a, b in zip(losses, expected))
        logit_diff = (logits - validator.saved_logits()).abs().max().item()
        tolerance = PARITY_TOLERANCE[spec.precision]
        # The LR schedule resumes where it stood: the same rates, exactly (older runs recorded none).
        lrs = [rec["lr"] for rec in records[0]]
        expected_lrs = (job.expected_lrs or [None] * len(job.expected_losses))[start:]
        same_lrs = lrs == expected_lrs or expected_lrs[0] is None
        return {"status": PASSED if len(losses) == len(expected) and max(loss_diff, logit_diff) <= tolerance
                and same_lrs else FAILED, "resumed_at_step": start, "steps_resumed": len(losses),
                "resumed_losses": losses, "uninterrupted_losses": expected, "max_abs_loss_diff": loss_diff,
                "resumed_lrs": lrs, "uninterrupted_lrs": expected_lrs, "lrs_identical": lrs == expected_lrs,
                "max_abs_final_logit_diff": logit_diff, "tolerance": tolerance,
                "how": f"fresh process loads the checkpoint saved after {start} steps (weights, optimizer, RNG, "
                       "data position, LR schedule) and trains to the end; losses vs the training run's own later "
                       "steps, learning rates identical, final logits vs the final checkpoint's"}

    validator.guarded("resume_parity", resume_parity)


def check_at_other_world_size(validator: ValidationRank, world_size: int) -> None:
    """The reshard check: the checkpoint loaded into a group of another world size."""
    import torch.distributed as dist

    from distlab.checkpoints import checkpoint as ckpt

    meta = ckpt.read_meta(validator.job.final)
    validator.spec = validator.job.spec.replace(world_size=world_size)

    def reshard():
        strategy, signature = validator.build(validator.spec)
        info = ckpt.load_checkpoint(validator.job.final, strategy, validator.ctx, signature, verify=False,
                                    allow_world_size=True)
        _, logits = validator.trained_outputs(strategy)
        if validator.rank != 0:
            return {}
        diff = (logits - validator.saved_logits()).abs().max().item()
        return {"status": PASSED if diff <= RELOAD_TOLERANCE else FAILED, "from_world_size": meta["world_size"],
                "to_world_size": dist.get_world_size(), "max_abs_logit_diff": diff, "tolerance": RELOAD_TOLERANCE,
                "load_seconds": info["load_seconds"],
                "how": "the final checkpoint loaded by the same strategy at another world size; its output on "
                       "the task's fixed batch (causal LM: state gathered one layer at a time, CPU fp32 logits) vs "
                       "the one recorded at save time"}

    if not validator.guarded("reshard", reshard):
        validator.checks["reshard"].update(from_world_size=meta["world_size"], to_world_size=dist.get_world_size())
        validator.record("reshard", validator.checks["reshard"])


def check_export_meanwhile_import(validator: ValidationRank, job: ValidationJob) -> None:
    """Before the phases: rank 0 checks the export (first: before this process loads anything
    else), while the other ranks import the model's code (transformers' modeling module, peft),
    which rank 0's check imports first thing. Otherwise they sat at the barrier through the
    check and then started those ~2 s of imports, one rank after the other."""
    if validator.rank == 0 and any(name == "same" for name, _ in job.plan):
        validator.guarded("export", lambda: validator.task.check_export(validator))
    else:
        validator.task.import_code(job.model_source, adapts(validator.spec))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="validator job file written by validate_run")
    args = parser.parse_args(argv)
    from distlab.launchers.process import die_with_parent

    die_with_parent(same_launch=True)  # a rank never outlives its launcher
    job = read_job(args.job)
    from distlab.runtime.tracking import hide_mlflow

    hide_mlflow(uses_it=False)  # validation tracks nothing; DeepSpeed's import would pull MLflow in
    import torch.distributed as dist

    started = time.time()
    validator = ValidationRank(job)
    check_export_meanwhile_import(validator, job)
    dist.barrier()
    for index, (name, world_size) in enumerate(job.plan):
        if index and not validator.shrink_to_one_rank():
            return
        (check_at_saved_world_size if name == "same" else check_at_other_world_size)(validator, world_size)
        print(f"validation {name} at world size {world_size}, rank {validator.rank}: "
              f"{time.time() - started:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()  # a finished rank skips the interpreter's teardown (~1.3 s of CPU)
