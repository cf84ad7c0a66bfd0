"""One rank of one experiment: `python -m distlab.worker --job job.json` under torchrun
(or the same `run_rank` under accelerate launch / a Ray Train worker).

Loads the base model, applies LoRA if asked, lets the strategy wrap it, verifies the
result matches the spec, trains, and has rank 0 write metrics.json and steps.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import checkpoint as ckpt
from distlab import metrics as M
from distlab.data import load_blocks, load_labels, run_data_facts
from distlab.evaluation import evaluate_run
from distlab.hardware import peak_flops_per_rank
from distlab.loop import IndexStream, gather, train
from distlab.memory import (OOM_EXIT_CODE, apply_memory_budget, budget_verdict, is_out_of_memory,  # noqa: F401
                            load_phase_record, memory_record, record_oom, rss_now)
from distlab.model_setup import prepare_model
from distlab.strategies import strategy_for
from distlab.strategies.base import RunContext, local_device




def make_context(job: dict) -> RunContext:
    spec = job["spec"]
    return RunContext(spec=spec, run_dir=job["run_dir"], device=local_device(spec),
                      rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), extras=job)


def coverage(records_by_rank: list[list[dict]], plans: list[list[int]], n_samples: int) -> dict:
    """Did data-parallel ranks read disjoint samples, and does the epoch plan cover the data?"""
    consumed = [sorted({i for rec in recs for i in rec["samples"]}) for recs in records_by_rank]
    reads = sum(len(rec["samples"]) for recs in records_by_rank for rec in recs)
    distinct = len(set().union(*map(set, consumed))) if consumed else 0
    overlap = len(set.intersection(*map(set, consumed))) if len(consumed) > 1 else 0
    planned = [set(p) for p in plans]
    union = set().union(*planned)
    pairwise_disjoint = sum(len(p) for p in planned) == len(union)
    return {
        "epoch_size": n_samples,
        "reads": reads,
        "distinct_samples_read": distinct,
        "duplicate_reads": reads - distinct,
        "duplicate_fraction": (reads - distinct) / reads if reads else 0.0,
        "samples_read_by_every_rank": overlap,
        "epoch_plan_disjoint": pairwise_disjoint,
        "epoch_plan_covered": len(union),
        "epoch_plan_dropped": n_samples - len(union),  # drop_last remainder
        "per_rank_reads": [sum(len(rec["samples"]) for rec in recs) for recs in records_by_rank],
    }



class TrainingCheckpoints:
    """This rank's checkpoint duties (layout in distlab/checkpoint.py): resume from resume/,
    periodic and parity saves, the final save into checkpoint/. Every method is collective."""

    def __init__(self, job: dict, ctx, strategy, signature: dict, n_samples: int):
        self.job, self.ctx, self.strategy, self.signature = job, ctx, strategy, signature
        self.spec = spec = ctx.spec
        self.enabled = bool(job.get("checkpoint_dir"))
        self.resume_root = Path(job["run_dir"]) / "resume"
        self.parity_step = spec["steps"] - ckpt.PARITY_STEPS if spec["steps"] > ckpt.PARITY_STEPS else None
        self.stream = IndexStream(n_samples, spec, strategy.data_parallel_rank, strategy.data_parallel_size)
        self.records: list = []
        self.unsupported = None
        self.report = {"resumed_from_steps": None, "skipped": [], "periodic_saves": []}

    def _log(self, message: str) -> None:
        if dist.get_rank() == 0:
            print(f"checkpoint: {message}", flush=True)

    def resume(self) -> int:
        """Steps already done: those of the newest resume/ checkpoint that loads, else 0."""
        if not self.enabled or not self.resume_root.is_dir():
            return 0
        found = sorted(p for p in self.resume_root.glob("step-*") if p.name.split("-")[1].isdigit())
        for path in reversed(found):
            try:
                info = ckpt.load_checkpoint(path, self.strategy, self.ctx, self.signature, stream=self.stream)
            except ckpt.CheckpointError as exc:
                self._log(f"not resuming from {path}: {exc}")
                self.report["skipped"].append(str(exc))
                dist.barrier()
                if dist.get_rank() == 0:
                    shutil.rmtree(path)  # unusable for this config; a fresh save replaces it
                continue
            self.records[:] = info["records"]
            self.report["resumed_from_steps"] = info["steps_done"]
            self._log(f"resumed from {path} ({info['steps_done']} steps done)")
            return info["steps_done"]
        return 0

    def on_step_end(self, step: int) -> None:
        done = step + 1
        every = self.spec["checkpoint_every"]
        due = done == self.parity_step or (every and done % every == 0)
        if self.enabled and self.unsupported is None and due and done < self.spec["steps"]:
            path = self.resume_root / f"step-{done:06d}"
            try:
                info = ckpt.save_checkpoint(path, self.strategy, self.ctx, self.job, self.signature, done,
                                            self.stream, self.records)
                self.report["periodic_saves"].append({"steps_done": done, "save_seconds": info["save_seconds"]})
            except NotImplementedError as exc:
                self.unsupported = str(exc)
                self._log(f"periodic checkpoints off: {exc}")
            if dist.get_rank() == 0 and self.unsupported is None:
                keep = {path.name, f"step-{self.parity_step:06d}" if self.parity_step else None}
                for old in self.resume_root.glob("step-*"):
                    if old.name not in keep:
                        shutil.rmtree(old)
        ckpt.maybe_inject_fault(self.spec, done)

    def finish(self) -> dict | None:
        """The final save (with the export); the parity checkpoint joins it; resume/ goes."""
        if not self.enabled:
            return None
        root = Path(self.job["checkpoint_dir"])
        try:
            info = ckpt.save_checkpoint(root / "final", self.strategy, self.ctx, self.job, self.signature,
                                        self.spec["steps"], self.stream, self.records, export=True)
        except NotImplementedError as exc:
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                (root / "UNSUPPORTED.json").write_text(json.dumps({"reason": str(exc)}))
            dist.barrier()
            return {"status": "unsupported", "reason": str(exc), **self.report}
        if dist.get_rank() == 0 and self.parity_step:
            parity = self.resume_root / f"step-{self.parity_step:06d}"
            if parity.is_dir():
                shutil.rmtree(root / parity.name, ignore_errors=True)
                os.replace(parity, root / parity.name)
            shutil.rmtree(self.resume_root, ignore_errors=True)
        dist.barrier()
        return {"status": "saved", "path": str(root / "final"), **info, **self.report,
                "parity_checkpoint": f"step-{self.parity_step:06d}" if self.parity_step else None}


def run_rank(job: dict, checkpoints_class=None) -> tuple[dict, list] | None:
    """Everything one rank does; returns (metrics, step rows) on rank 0, None elsewhere.

    checkpoints_class: a TrainingCheckpoints subclass (the Ray launcher's reports to Ray)."""
    started = time.time()
    spec = job["spec"]
    if spec["device"] == "cpu":
        # On CPU a "device" is cpu_threads_per_rank cores, the same for every world size.
        torch.set_num_threads(spec["cpu_threads_per_rank"])
    ctx = make_context(job)
    budget = apply_memory_budget(ctx)
    strategy = strategy_for(spec)(ctx)
    strategy.init_distributed()
    ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()

    rss_before_model = rss_now()  # interpreter + libraries + process group: what a rank costs before its model
    prepared = prepare_model(strategy, job["model_source"], spec)
    described, flops, counts = prepared.described, prepared.flops, prepared.parameter_counts
    lora_targets, signature = prepared.lora_targets, prepared.signature

    train_blocks = load_blocks(job["data_dir"], "train")
    if train_blocks.shape[1] != spec["seq_len"]:
        raise ValueError(f"data blocks are {train_blocks.shape[1]} tokens, spec seq_len is {spec['seq_len']}")

    checkpoints = (checkpoints_class or TrainingCheckpoints)(job, ctx, strategy, signature, len(train_blocks))
    start_step = checkpoints.resume()
    load_phase = load_phase_record(ctx.device, rss_before_model)  # process start -> first step
    result = train(ctx, strategy, train_blocks, start_step=start_step, stream=checkpoints.stream,
                   on_step_end=checkpoints.on_step_end, records=checkpoints.records,
                   train_labels=load_labels(job["data_dir"], "train"))
    described.update(strategy.finish() or {})
    stream, records = result["stream"], result["records"]
    state_bytes = result["state_bytes"]
    memory = memory_record(ctx, load_phase)
    memory["budget"] = budget_verdict(budget, memory, state_bytes)

    all_records = gather(records)
    plans = gather(stream.epoch_plan())
    all_state = gather(state_bytes)
    all_memory = gather(memory)
    comm = gather([r["comm_inflight_s"] for r in records])
    evaluation = evaluate_run(strategy, job)  # collective: the trained model on the held-out tokens

    if ctx.is_main:
        out = summarize_run(job, ctx, strategy, described, flops, counts, lora_targets, all_records, plans,
                            all_state, all_memory, comm, len(train_blocks), started)
    else:
        out = None
    saved = checkpoints.finish()
    if out is not None:
        out[0]["checkpoint"] = saved
        out[0]["eval"] = evaluation
    return out


def summarize_run(job, ctx, strategy, described, flops, counts, lora_targets, all_records, plans, all_state,
                  all_memory, comm, n_samples, started) -> dict:
    spec = job["spec"]
    hardware = json.loads(Path(job["hardware_json"]).read_text())
    warm = spec["warmup_steps"]
    # A step ends when the slowest rank finishes: the step time is the max over ranks.
    step_times = [max(recs[i]["step_time_s"] for recs in all_records) for i in range(len(all_records[0]))]
    losses = []
    for i in range(len(all_records[0])):
        values = [recs[i]["loss"] for recs in all_records if recs[i]["loss"] is not None]
        losses.append(sum(values) / len(values) if values else None)
    timed = M.summarize(step_times[warm:])
    dp = strategy.data_parallel_size
    samples_per_step = spec["micro_batch"] * spec["grad_accum"] * dp
    tokens_per_step = samples_per_step * spec["seq_len"]
    tps = tokens_per_step / timed["median"]
    peak, peak_how = peak_flops_per_rank(ctx.device, spec, hardware)
    per_rank_tps = tps / ctx.world_size
    measured = all(v is not None for c in comm for v in c)
    comm_per_step = [max(c[i] for c in comm) if measured else None for i in range(len(step_times))]
    return {
        "schema_version": M.METRICS_SCHEMA_VERSION,
        "experiment": spec["id"],
        "stage": spec["stage"],
        "machine": hardware["machine"],
        "status": "ok",
        "spec": spec,
        "actual": described,
        "parameters": counts,
        "lora_targets": lora_targets,
        "loss": {"first": losses[0], "last": losses[-1], "per_step": losses},
        "timing": {
            "step_time_s": timed,
            "how": f"wall time of each optimizer step (max over ranks), steps {warm}..{len(step_times) - 1} "
                   f"after {warm} warm-up steps; median and spread",
            "comm_inflight_s_per_step": M.summarize(comm_per_step[warm:] if measured else []),
            "comm_how": ("all-reduce launch-to-completion time per step (overlaps backward); from a DDP comm hook "
                         "or the strategy's own counter") if measured else
                        f"not measured for strategy {spec['strategy']}: " + getattr(
                            strategy, "comm_unmeasured_reason", "its collectives are not timed without changing them"),
        },
        "throughput": {
            "tokens_per_s": tps, "samples_per_s": samples_per_step / timed["median"],
            "tokens_per_s_per_rank": per_rank_tps, "samples_per_step": samples_per_step,
            "tokens_per_step": tokens_per_step,
        },
        "flops": {**flops, "peak_flops_per_rank": peak, "peak_how": peak_how,
                  "mfu": M.mfu(flops["flops_per_token"], per_rank_tps, peak)},
        "memory": {"per_rank": all_memory, "model_state_bytes_per_rank": all_state},
        "data": coverage(all_records, plans, n_samples),
        "data_prep": run_data_facts(job["data_dir"], all_records, ctx.world_size // dp),  # tokenizer identity, tokens trained/masked
        "versions": M.library_versions(),
        "environment": M.allowed_environment(job.get("env_allowlist", [])),
        "wall_seconds_rank0": time.time() - started,
    }, [
        {"step": i, "loss": losses[i], "step_time_s": step_times[i], "comm_inflight_s": comm_per_step[i],
         "warmup": i < warm, "samples_by_rank": [recs[i]["samples"] for recs in all_records]}
        for i in range(len(step_times))
    ]


def _nan_to_none(value):
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def write_outputs(run_dir: str, summary) -> None:
    metrics, steps = summary
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "steps.jsonl", "w") as fh:
        for row in steps:
            fh.write(json.dumps(row) + "\n")
    # Strict JSON (no NaN): a figure that was not measured is null, with its reason beside it.
    (run / "metrics.json").write_text(json.dumps(_nan_to_none(metrics), indent=1, default=str))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="job.json written by distlab.launch")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="accepted for the deepspeed launcher; LOCAL_RANK is used")
    args = parser.parse_args(argv)
    from distlab.launchers.process import die_with_parent

    die_with_parent(parent_names=args.job)  # a rank never outlives its launcher
    job = json.loads(Path(args.job).read_text())
    try:
        summary = run_rank(job)
    except Exception as error:  # noqa: BLE001 - only allocation failures are handled; the rest re-raise
        if not is_out_of_memory(error):
            raise
        record_oom(job, error)
        # Peers may be blocked in a collective: exit hard, torchrun tears the group down.
        os._exit(OOM_EXIT_CODE)
    if summary is not None:
        metrics, steps = summary
        write_outputs(job["run_dir"], (metrics, steps))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
