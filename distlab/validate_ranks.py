"""The validation ranks (`python -m distlab.validate_ranks --job job.json`, started by
distlab.validate under the experiment's launcher): build the strategy exactly as the worker
does, load checkpoints through the Strategy interface and record each check.

A launch runs its plan's phases in order: "same" (saved world size: compatibility, reload,
LoRA base weights, resume parity) and "reshard" (other world size). The export check runs
first, on rank 0, before this process loads anything else.
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

from distlab.validate import (FAILED, MERGE_TOLERANCE, PARITY_TOLERANCE, PASSED, RELOAD_TOLERANCE, UNSUPPORTED)


class ValidationRank:
    """One validation rank: builds strategies like the worker does and records checks."""

    def __init__(self, job: dict):
        import torch
        import torch.distributed as dist

        from distlab.strategies import strategy_for
        from distlab.worker import make_context

        self.job, self.spec = job, dict(job["spec"], world_size=job["plan"][0][1])
        if self.spec["device"] == "cpu":
            torch.set_num_threads(self.spec["cpu_threads_per_rank"])
        self.ctx = make_context(job)
        self.ctx.spec = self.spec
        self.strategy_cls = strategy_for(self.spec)
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
            Path(self.job["out"]).write_text(json.dumps(self.checks, indent=1, default=str))

    def guarded(self, name: str, check) -> bool:
        """Run one check; NotImplementedError = unsupported, CheckpointError = failed (every rank
        agrees on both). Anything else ends the ranks, so none waits forever in a collective."""
        from distlab.checkpoint import CheckpointError

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

    def build(self, spec: dict):
        """A fresh model + strategy exactly as the worker builds them; returns (strategy, signature)."""
        from distlab.model_setup import prepare_model

        self.ctx.spec = spec
        strategy = self.strategy_cls(self.ctx)
        strategy.init_distributed()  # joins the existing group; some strategies set up their state here
        return strategy, prepare_model(strategy, self.job["model_source"], spec).signature

    def consolidated_logits(self, strategy):
        """Collective: the strategy's full state in a plain HF model, its logits on rank 0."""
        from distlab import checkpoint as ckpt

        full = strategy.full_state_dict()
        if self.rank != 0:
            return None, None
        model = ckpt.consolidated_model(full, self.job["model_source"], self.spec)
        return model, ckpt.logits_of(model, ckpt.eval_batch(self.job["data_dir"]))

    def saved_logits(self):
        from safetensors.torch import load_file

        return load_file(str(Path(self.job["final"]) / "eval_logits.safetensors"))["logits"]


def check_export(validator: ValidationRank) -> dict:
    """Rank 0, before loading anything else: the export as a user would open it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distlab import checkpoint as ckpt

    folder = Path(validator.job["final"]) / "export"
    if not folder.is_dir():
        meta = ckpt.read_meta(validator.job["final"])
        raise NotImplementedError((meta["save"].get("export") or {}).get("reason", "no export was written"))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    batch = ckpt.eval_batch(validator.job["data_dir"])
    saved = validator.saved_logits()
    diff = (ckpt.logits_of(model, batch) - saved).abs().max().item()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = batch[:1, :8]
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new_tokens = generated.shape[1] - prompt.shape[1]
    tolerance = MERGE_TOLERANCE if validator.spec["method"] == "lora" else RELOAD_TOLERANCE
    out = {"path": str(folder), "max_abs_logit_diff": diff, "tolerance": tolerance, "generated_tokens": new_tokens,
           "generated_text": tokenizer.decode(generated[0]),
           "how": "AutoModelForCausalLM.from_pretrained(export) in a validation process; logits on the fixed eval "
                  "batch vs those recorded at save time; greedy generate of 8 tokens"}
    ok = diff <= tolerance and new_tokens > 0
    if validator.spec["method"] == "lora":
        from peft import PeftModel

        from distlab.model import load_model

        adapted = PeftModel.from_pretrained(load_model(validator.job["model_source"]), str(folder / "adapter")).eval()
        out["adapter_max_abs_logit_diff"] = (ckpt.logits_of(adapted, batch) - saved).abs().max().item()
        out["adapter_tolerance"] = RELOAD_TOLERANCE
        out["how"] += "; LoRA: PeftModel.from_pretrained(base, export/adapter) compared too, the top folder is merged"
        ok = ok and out["adapter_max_abs_logit_diff"] <= RELOAD_TOLERANCE
    return {"status": PASSED if ok else FAILED, **out}


def lora_base_frozen(model, model_source: str) -> dict:
    """Frozen base weights after reload vs a freshly loaded base model: bit for bit."""
    import torch

    from distlab.model import load_model

    base = load_model(model_source).state_dict()
    compared, changed = 0, []
    for name, tensor in model.get_base_model().state_dict().items():
        if "lora_" in name:
            continue
        compared += 1
        key = name.replace(".base_layer", "")
        # The base as the strategy keeps it (LoRA bf16: bf16, strategies.base.frozen_base_dtype).
        if key not in base or not torch.equal(tensor, base[key].to(tensor.dtype)):
            changed.append(name)
    return {"status": PASSED if compared and not changed else FAILED, "tensors_compared": compared,
            "changed": changed[:20], "tolerance": "bit-identical (torch.equal)"}


def check_at_saved_world_size(validator: ValidationRank, world_size: int) -> None:
    """Reload, parity and resume checks in a group of the world size the run saved at."""
    import torch.distributed as dist

    from distlab import checkpoint as ckpt
    from distlab.data import load_blocks, load_labels
    from distlab.loop import IndexStream, gather, train

    job = validator.job
    spec = validator.spec = dict(job["spec"], world_size=world_size)
    strategy, signature = validator.build(spec)
    meta = ckpt.read_meta(job["final"])

    def compatibility():
        ckpt.check_compatible(meta, spec, signature, job["final"])
        return {"status": PASSED, "how": "model config, parameter shapes and experiment spec vs the checkpoint's"}

    if not validator.guarded("compatibility", compatibility):
        return

    def reload():
        info = ckpt.load_checkpoint(job["final"], strategy, validator.ctx, signature, verify=False)
        model, logits = validator.consolidated_logits(strategy)
        if validator.rank != 0:
            return {}
        diff = (logits - validator.saved_logits()).abs().max().item()
        if spec["method"] == "lora":
            validator.record("lora_base_frozen", lora_base_frozen(model, job["model_source"]))
        return {"status": PASSED if diff <= RELOAD_TOLERANCE else FAILED, "max_abs_logit_diff": diff,
                "tolerance": RELOAD_TOLERANCE, "world_size": dist.get_world_size(),
                "load_seconds": info["load_seconds"],
                "how": "fresh model + strategy, strategy.load_checkpoint, full_state_dict into a plain HF model; "
                       "fp32 logits on the fixed eval batch vs those recorded at save time"}

    validator.guarded("reload", reload)
    strategy = None  # the parity check builds its own; free this one first
    gc.collect()
    if not job["parity"]:
        validator.record("resume_parity", {"status": UNSUPPORTED, "reason": f"steps ({spec['steps']}) <= "
                                       f"{ckpt.PARITY_STEPS}: no mid-run checkpoint to resume from"})
        return

    def resume_parity():
        strategy, signature = validator.build(spec)
        blocks = load_blocks(job["data_dir"], "train")
        stream = IndexStream(len(blocks), spec, strategy.data_parallel_rank, strategy.data_parallel_size)
        info = ckpt.load_checkpoint(job["parity"], strategy, validator.ctx, signature, stream=stream, verify=False)
        start = info["steps_done"]
        records = gather(train(validator.ctx, strategy, blocks, start_step=start, stream=stream,
                               train_labels=load_labels(job["data_dir"], "train"))["records"])
        model, logits = validator.consolidated_logits(strategy)
        if validator.rank != 0:
            return {}
        losses = []
        for i in range(len(records[0])):
            values = [recs[i]["loss"] for recs in records if recs[i]["loss"] is not None]
            losses.append(sum(values) / len(values))
        expected = job["expected_losses"][start:]
        loss_diff = max(abs(a - b) for a, b in zip(losses, expected))
        logit_diff = (logits - validator.saved_logits()).abs().max().item()
        tolerance = PARITY_TOLERANCE[spec["precision"]]
        # The LR schedule resumes where it stood: the same rates, exactly (older runs recorded none).
        lrs = [rec["lr"] for rec in records[0]]
        expected_lrs = (job.get("expected_lrs") or [None] * len(job["expected_losses"]))[start:]
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

    from distlab import checkpoint as ckpt

    meta = ckpt.read_meta(validator.job["final"])
    validator.spec = dict(validator.job["spec"], world_size=world_size)

    def reshard():
        strategy, signature = validator.build(validator.spec)
        info = ckpt.load_checkpoint(validator.job["final"], strategy, validator.ctx, signature, verify=False,
                                    allow_world_size=True)
        _, logits = validator.consolidated_logits(strategy)
        if validator.rank != 0:
            return {}
        diff = (logits - validator.saved_logits()).abs().max().item()
        return {"status": PASSED if diff <= RELOAD_TOLERANCE else FAILED, "from_world_size": meta["world_size"],
                "to_world_size": dist.get_world_size(), "max_abs_logit_diff": diff, "tolerance": RELOAD_TOLERANCE,
                "load_seconds": info["load_seconds"],
                "how": "the final checkpoint loaded by the same strategy at another world size; consolidated "
                       "logits vs those recorded at save time"}

    if not validator.guarded("reshard", reshard):
        validator.checks["reshard"].update(from_world_size=meta["world_size"], to_world_size=dist.get_world_size())
        validator.record("reshard", validator.checks["reshard"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="validator job file written by validate_run")
    args = parser.parse_args(argv)
    from distlab.launchers.process import die_with_parent

    die_with_parent(parent_names=args.job)  # a rank never outlives its launcher
    job = json.loads(Path(args.job).read_text())
    import torch.distributed as dist

    started = time.time()
    validator = ValidationRank(job)
    if validator.rank == 0 and any(name == "same" for name, _ in job["plan"]):
        validator.guarded("export", lambda: check_export(validator))  # first: before this process loads anything else
    dist.barrier()
    for index, (name, world_size) in enumerate(job["plan"]):
        if index and not validator.shrink_to_one_rank():
            return
        (check_at_saved_world_size if name == "same" else check_at_other_world_size)(validator, world_size)
        print(f"validation {name} at world size {world_size}, rank {validator.rank}: "
              f"{time.time() - started:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
