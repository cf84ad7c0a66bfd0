"""The validation ranks (`python -m distlab.validate_ranks --job job.json`, started by
distlab.validate under the experiment's launcher): build the strategy exactly as the worker
does, load checkpoints through the Strategy interface and record each check.

A launch runs its plan's phases in order: "same" (saved world size: compatibility, reload,
LoRA base weights, resume parity) and "reshard" (other world size). The export check runs
first, on rank 0, before this process loads anything else.

Every logit compared here is computed the way the recorded ones were (distlab.streamed: on
rank 0's CPU in fp32, the weights arriving one decoder layer at a time): from a reloaded
strategy's gathered state, or from the export's files. No process holds a whole model.
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
        from distlab.tasks import task_for
        from distlab.worker import make_context

        self.job, self.spec = job, dict(job["spec"], world_size=job["plan"][0][1])
        if self.spec["device"] == "cpu":
            torch.set_num_threads(self.spec["cpu_threads_per_rank"])
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

    def trained_outputs(self, strategy):
        """Collective: (a plain model or None, the trained state's output on the task's fixed
        batch) on rank 0, (None, None) elsewhere (Task.trained_outputs; causal LM:
        streamed_outputs)."""
        return self.task.trained_outputs(self, strategy)

    def saved_logits(self, name: str = "logits"):
        from safetensors.torch import load_file

        return load_file(str(Path(self.job["final"]) / "eval_logits.safetensors"))[name]


def export_logits(folder: Path, batch, skeleton=None, base_folder=None, cast=None):
    """Streamed CPU logits of a Hugging Face folder as a user would load it: its own config.json
    and weight files, one layer at a time. LoRA: `skeleton` is the PeftModel peft built on a
    meta base from the adapter folder, the base weights read from `base_folder`."""
    from distlab.model import load_model
    from distlab.partial_load import checkpoint_names
    from distlab.streamed import Skeleton, file_groups, open_weights, streamed_logits

    if skeleton is None:
        skeleton = Skeleton(load_model(str(folder), device="meta"))
        with open_weights(folder) as reader:
            return streamed_logits(skeleton, file_groups(skeleton, reader, cast=cast), batch)
    from distlab.export_files import weight_index
    from distlab.lora import base_name

    base = skeleton.model.get_base_model()
    stored = checkpoint_names(base, weight_index(base_folder))
    keys = {name: stored[base_name(name)] for name in skeleton.shapes if "lora_" not in name}
    with open_weights(base_folder, keys) as reader:
        return streamed_logits(skeleton, file_groups(skeleton, reader, cast=cast,
                                                     select=lambda n: "lora_" not in n), batch)


def adapter_skeleton(folder: Path, source: str):
    """The base on the meta device with the adapter folder applied by peft (its config reader and
    weight loader): the adapters real and in place, the base weights to be streamed. Every
    adapter of the model must be in the file and every tensor of the file an adapter."""
    import torch
    from peft import PeftConfig, get_peft_model
    from peft.utils import load_peft_weights

    from distlab.model import load_model
    from distlab.streamed import Skeleton

    config = PeftConfig.from_pretrained(str(folder))
    with torch.random.fork_rng(devices=[]):
        skeleton = Skeleton(get_peft_model(load_model(source, device="meta"), config))
    stored = load_peft_weights(str(folder))
    # peft stores each adapter without its adapter name ("lora_A.default.weight" -> "lora_A.weight").
    wanted = {name: name.replace(".default.", ".", 1) for name in skeleton.shapes if "lora_" in name}
    missing = sorted(k for k in wanted.values() if k not in stored)
    unexpected = sorted(set(stored) - set(wanted.values()))
    if missing or unexpected:
        raise ValueError(f"{folder}: adapter file and model disagree: missing {missing[:3]}, unexpected {unexpected[:3]}")
    skeleton.place({name: stored[key].float() for name, key in wanted.items()})
    skeleton.fixed |= set(wanted)
    skeleton.resident -= set(wanted)  # never released by the streamed forward
    return skeleton


def export_layout(folder: Path) -> dict:
    """The export's weight files against what save_pretrained writes for its own config."""
    from distlab.export_files import shard_plan, weight_index
    from distlab.model import load_model

    plan = shard_plan(load_model(str(folder), device="meta"))
    wanted = {name: file for file, entries in plan["files"].items() for name in entries}
    found = weight_index(folder)
    return {"files_as_save_pretrained": found == wanted,
            "missing": sorted(set(wanted) - set(found))[:5], "unexpected": sorted(set(found) - set(wanted))[:5],
            "files": sorted(set(found.values()))}


def check_export(validator: ValidationRank) -> dict:
    """Rank 0, before loading anything else: the export as a user would open it (its config,
    its files; LoRA: peft's PeftModel.from_pretrained on the base), run streamed, vs the
    logits recorded at save time."""
    import torch

    from distlab import checkpoint as ckpt
    from distlab.export import MERGED, eval_batch
    from distlab.partial_load import model_folder

    final = Path(validator.job["final"])
    folder = final / "export"
    meta = ckpt.read_meta(final)
    if not folder.is_dir():
        raise NotImplementedError((meta["save"].get("export") or {}).get("reason", "no export was written"))
    saved_export = meta["save"].get("export") or {}
    batch, saved = eval_batch(validator.job["data_dir"]), validator.saved_logits()
    spec, source = validator.spec, validator.job["model_source"]
    out = {"path": str(folder), "tolerance": RELOAD_TOLERANCE,
           "how": "the export's own files read one decoder layer at a time and run on the CPU in fp32 (no process "
                  "holds the whole model); logits on the fixed eval batch vs those recorded at save time"}
    if spec["method"] == "lora":
        skeleton = adapter_skeleton(folder, source)
        base_dtype = saved_export.get("base_weights_dtype")
        cast = getattr(torch, base_dtype) if isinstance(base_dtype, str) else None
        logits = export_logits(folder, batch, skeleton, model_folder(source), cast=cast)
        out["how"] += ("; LoRA: peft's own readers of the adapter folder (PeftConfig.from_pretrained, "
                       f"load_peft_weights), base weights from {source}"
                       + (f" held as {base_dtype} as in training" if cast else ""))
        if (folder / MERGED).is_dir():
            merged = export_logits(folder / MERGED, batch)
            out.update(merged_max_abs_logit_diff=(merged - saved).abs().max().item(),
                       merged_tolerance=MERGE_TOLERANCE, merged_layout=export_layout(folder / MERGED))
    else:
        logits = export_logits(folder, batch)
        out["layout"] = export_layout(folder)
    out["max_abs_logit_diff"] = (logits - saved).abs().max().item()
    ok = out["max_abs_logit_diff"] <= RELOAD_TOLERANCE and out.get("layout", {}).get("files_as_save_pretrained", True)
    if "merged_max_abs_logit_diff" in out:
        ok = ok and out["merged_max_abs_logit_diff"] <= MERGE_TOLERANCE \
            and out["merged_layout"]["files_as_save_pretrained"]
    training = saved_export.get("training_vs_streamed_max_abs_logit_diff")
    if training is not None:
        # The gathered weights are the model that trained: its own forward (sharded, on its
        # device, training precision) against the streamed one. Checked where both are CPU fp32.
        out["training_model_max_abs_logit_diff"] = training
        if spec["device"] == "cpu" and spec["precision"] == "fp32":
            out["training_model_tolerance"] = RELOAD_TOLERANCE
            ok = ok and training <= RELOAD_TOLERANCE
        else:
            out["training_model_note"] = (f"recorded, not checked: the training model ran on {spec['device']} in "
                                          f"{spec['precision']}, the streamed forward on the CPU in fp32")
    return {"status": PASSED if ok else FAILED, **out}


def streamed_outputs(validator: ValidationRank, strategy):
    """Collective: the strategy's state gathered one layer at a time (Strategy.state_groups),
    run on rank 0's CPU in fp32: (None, logits of the fixed eval batch) on rank 0, (None, None)
    elsewhere (no process holds the whole model)."""
    from distlab.export import eval_batch
    from distlab.streamed import Skeleton, streamed_logits

    groups = strategy.state_groups()
    if validator.rank != 0:
        for _ in groups:
            pass
        return None, None
    return None, streamed_logits(Skeleton.for_run(validator.job["model_source"], validator.spec), groups,
                                 eval_batch(validator.job["data_dir"]))


def lora_base_frozen(model, source: str, meta: dict, now: dict, reload_diff: float) -> dict:
    """A LoRA checkpoint holds no base weight: the base it names (sha256 of its files) must be
    the folder's (`now`, checkpoint.base_identity), and base + reloaded adapters must give the
    logits of the trained state."""
    saved = meta.get("base_model") or {}
    source = now["source"]
    same = bool(saved) and saved.get("weights_sha256") == now["weights_sha256"]
    ok = same and reload_diff <= RELOAD_TOLERANCE
    return {"status": PASSED if ok else FAILED, "base_identity_matches": same, "base_files": sorted(now["weights_sha256"]),
            "reload_max_abs_logit_diff": reload_diff, "tolerance": RELOAD_TOLERANCE,
            "how": "the checkpoint holds adapters only; the base it names by the sha256 of its weight files equals "
                   f"{source}'s, and that base + the reloaded adapters reproduce the trained model's logits "
                   "(the reload check): the base stayed frozen"}


def check_at_saved_world_size(validator: ValidationRank, world_size: int) -> None:
    """Reload, parity and resume checks in a group of the world size the run saved at."""
    import torch.distributed as dist

    from distlab import checkpoint as ckpt
    from distlab.loop import IndexStream, gather, train

    job = validator.job
    spec = validator.spec = dict(job["spec"], world_size=world_size)
    strategy, signature = validator.build(spec)
    meta = ckpt.read_meta(job["final"])
    source = job["model_source"]  # LoRA: the frozen base's identity (collective), of the task's weight files
    base = ckpt.base_identity(source, validator.task.weights_folder(source)) if spec["method"] == "lora" else None

    def compatibility():
        ckpt.check_compatible(meta, spec, signature, job["final"])
        ckpt.check_base(meta, base, job["final"])
        return {"status": PASSED, "how": "model config, parameter shapes and experiment spec vs the checkpoint's"
                + ("; LoRA: the base model's weight files (sha256) vs those it names" if base else "")}

    if not validator.guarded("compatibility", compatibility):
        return

    def reload():
        info = ckpt.load_checkpoint(job["final"], strategy, validator.ctx, signature, verify=False, base=base)
        model, logits = validator.trained_outputs(strategy)
        if validator.rank != 0:
            return {}
        diff = (logits - validator.saved_logits()).abs().max().item()
        if spec["method"] == "lora":
            validator.record("lora_base_frozen",
                             validator.task.lora_base_frozen(model, job["model_source"], meta, base, diff))
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
    if not job["parity"]:
        validator.record("resume_parity", {"status": UNSUPPORTED, "reason": f"steps ({spec['steps']}) <= "
                                       f"{ckpt.PARITY_STEPS}: no mid-run checkpoint to resume from"})
        return

    def resume_parity():
        strategy, signature = validator.build(spec)
        data = validator.task.train_data(job, spec, validator.ctx.device)
        stream = IndexStream(len(data), spec, strategy.data_parallel_rank, strategy.data_parallel_size,
                             getattr(strategy, "rank_batches", None))
        info = ckpt.load_checkpoint(job["parity"], strategy, validator.ctx, signature, stream=stream, verify=False,
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


def check_export_meanwhile_import(validator: ValidationRank, job: dict) -> None:
    """Before the phases: rank 0 checks the export (first: before this process loads anything
    else), while the other ranks import the model's code (transformers' modeling module, peft),
    which rank 0's check imports first thing. Otherwise they sat at the barrier through the
    check and then started those ~2 s of imports, one rank after the other."""
    if validator.rank == 0 and any(name == "same" for name, _ in job["plan"]):
        validator.guarded("export", lambda: validator.task.check_export(validator))
    else:
        validator.task.import_code(job["model_source"], validator.spec["method"] == "lora")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="validator job file written by validate_run")
    args = parser.parse_args(argv)
    from distlab.launchers.process import die_with_parent

    die_with_parent(same_launch=True)  # a rank never outlives its launcher
    job = json.loads(Path(args.job).read_text())
    from distlab.tracking import hide_mlflow

    hide_mlflow(uses_it=False)  # validation tracks nothing; DeepSpeed's import would pull MLflow in
    import torch.distributed as dist

    started = time.time()
    validator = ValidationRank(job)
    check_export_meanwhile_import(validator, job)
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
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()  # a finished rank skips the interpreter's teardown (~1.3 s of CPU)
