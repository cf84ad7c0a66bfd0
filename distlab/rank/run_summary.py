"""What a run measured, in the form metrics.json and steps.jsonl hold: every rank's records
gathered, then rank 0 summarises timing, throughput, MFU, memory, data coverage."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from distlab.records.spec import Spec
from distlab.records import metrics as M
from distlab.configuration.hardware import peak_flops_per_rank
from distlab.records.job import Job
from distlab.rank.loop import gather
from distlab.runtime.noise import summarize_noise


def gather_ranks(result: dict, memory: dict) -> dict:
    """Collective: every rank's step records, epoch plan, state bytes, memory record and
    per-step communication time, as lists indexed by rank."""
    records = result["records"]
    return {"records": gather(records), "plans": gather(result["stream"].epoch_plan()),
            "state_bytes": gather(result["state_bytes"]), "memory": gather(memory),
            "comm": gather([r["comm_inflight_s"] for r in records]), "noise": gather(result.get("noise"))}


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


def per_rank_timing(all_records: list[list[dict]], comm: list[list], warm: int) -> list[dict]:
    """Each rank's own median step time, collective time in flight and samples per step (after
    warm-up): where unequal ranks spend their steps (a fast rank's extra time in flight is
    time spent waiting for the slow one)."""
    rows = []
    for rank, records in enumerate(all_records):
        timed = records[warm:]
        in_flight = [c for c in comm[rank][warm:] if c is not None]
        rows.append({"rank": rank, "step_time_s_median": M.summarize([r["step_time_s"] for r in timed])["median"],
                     "comm_inflight_s_median": M.summarize(in_flight)["median"] if in_flight else None,
                     "samples_per_step": len(timed[0]["samples"]) if timed else None})
    return rows


def optimization(spec: Spec, all_records: list[list[dict]]) -> dict:
    """The learning rate and pre-clip gradient norm of every step, with what set them."""
    from distlab.runtime.schedule import scheduler_name

    first = all_records[0]
    return {"lr_per_step": [r.get("lr") for r in first], "grad_norm_per_step": [r.get("grad_norm") for r in first],
            "lr_schedule": scheduler_name(spec), "lr_warmup_steps": spec.lr_warmup_steps,
            "max_grad_norm": spec.max_grad_norm,
            "how": "lr read from the optimizer's param_groups before each step (transformers.get_scheduler, "
                   "stepped once per optimizer step); grad_norm = global L2 norm of the gradients before clipping "
                   "(distlab.runtime.clipping; DeepSpeed ZeRO 1-3: engine.get_global_grad_norm)"}


def step_extras(all_records: list[list[dict]], i: int) -> dict:
    """Step i's learning rate and pre-clip gradient norm (rank 0's: every rank's are the same
    global figures), and the largest memory any rank held after it (distlab.rank.monitor)."""
    first = all_records[0][i]
    memory = [recs[i].get("memory_bytes") for recs in all_records if recs[i].get("memory_bytes") is not None]
    ev = first.get("eval") or {}
    return {"lr": first.get("lr"), "grad_norm": first.get("grad_norm"), "memory_bytes": max(memory) if memory else None,
            "eval_loss": ev.get("loss"), "eval_perplexity": ev.get("perplexity")}


def summarize_run(job: Job, ctx, strategy, prepared, ranks: dict, n_samples: int, started: float):
    """Rank 0: (metrics.json's dict, steps.jsonl's rows) from what gather_ranks collected."""
    spec = ctx.spec
    flops = prepared.flops
    all_records, all_memory, comm = ranks["records"], ranks["memory"], ranks["comm"]
    hardware = json.loads(Path(job.hardware_json).read_text())
    warm = ctx.untimed_steps  # the spec's, or fewer for an elastic Ray group resumed near the end
    # A step ends when the slowest rank finishes: the step time is the max over ranks.
    step_times = [max(recs[i]["step_time_s"] for recs in all_records) for i in range(len(all_records[0]))]
    losses = []
    for i in range(len(all_records[0])):
        # Weighted by each rank's samples: ranks of unequal micro-batches (distlab.runtime.unequal) hold
        # unequal shares of the step's batch; equal shares give the plain mean.
        values = [(recs[i]["loss"], len(recs[i]["samples"]) or 1) for recs in all_records
                  if recs[i]["loss"] is not None]
        losses.append(sum(v * w for v, w in values) / sum(w for _, w in values) if values else None)
    timed = M.summarize(step_times[warm:])
    dp = strategy.data_parallel_size
    task = strategy.task
    unit = task.unit  # what throughput and MFU count: tokens (causal LM), images (text-to-image)
    samples_per_step = spec.micro_batch * spec.grad_accum * dp
    units_per_step = samples_per_step * task.units_per_sample(spec)
    units_per_s = units_per_step / timed["median"]
    peak, peak_how = peak_flops_per_rank(ctx.device, spec, hardware)
    units_per_s_per_rank = units_per_s / ctx.world_size
    measured = all(v is not None for c in comm for v in c)
    comm_per_step = [max(c[i] for c in comm) if measured else None for i in range(len(step_times))]
    return {
        "schema_version": M.METRICS_SCHEMA_VERSION,
        "experiment": spec.id,
        "stage": spec.stage,
        "machine": hardware["machine"],
        "status": "ok",
        "spec": spec,
        "as_built": prepared.described,
        "parameters": prepared.parameter_counts,
        "lora_targets": prepared.lora_targets,
        "loss": {"first": losses[0], "last": losses[-1], "per_step": losses},
        "optimization": optimization(spec, all_records),
        "timing": {
            "step_time_s": timed, "untimed_steps": warm,
            "how": f"wall time of each optimizer step (max over ranks), steps {warm}..{len(step_times) - 1} "
                   f"after {warm} untimed steps; median and spread",
            "comm_inflight_s_per_step": M.summarize(comm_per_step[warm:] if measured else []),
            "comm_how": ("all-reduce launch-to-completion time per step (overlaps backward); from a DDP comm hook "
                         "or the strategy's own counter") if measured else
                        f"not measured for strategy {spec.strategy}: " + getattr(
                            strategy, "comm_unmeasured_reason", "its collectives are not timed without changing them"),
        },
        "timing_per_rank": per_rank_timing(all_records, comm, warm),
        "throughput": {
            f"{unit}s_per_s": units_per_s, "samples_per_s": samples_per_step / timed["median"],
            f"{unit}s_per_s_per_rank": units_per_s_per_rank, "samples_per_step": samples_per_step,
            f"{unit}s_per_step": units_per_step, "unit": unit,
        },
        "flops": {**flops, "peak_flops_per_rank": peak, "peak_how": peak_how,
                  "mfu": M.mfu(flops[f"flops_per_{unit}"], units_per_s_per_rank, peak)},
        "memory": {"per_rank": all_memory, "model_state_bytes_per_rank": ranks["state_bytes"]},
        # Cores the run occupies: its ranks x the threads each computes with (torch's own setting).
        "noise": summarize_noise(ranks["noise"], ctx.world_size * torch.get_num_threads()),
        "data": coverage(all_records, ranks["plans"], n_samples),
        # causal LM: tokenizer identity, tokens trained/masked
        "data_prep": task.data_facts(job, all_records, ctx.world_size // dp),
        "versions": M.library_versions(),
        "environment": M.allowed_environment(job.env_allowlist),
        "wall_seconds_rank0": time.time() - started,
    }, [
        {"step": i, "loss": losses[i], "step_time_s": step_times[i], "comm_inflight_s": comm_per_step[i],
         "untimed": i < warm, **step_extras(all_records, i),
         "samples_by_rank": [recs[i]["samples"] for recs in all_records]}
        for i in range(len(step_times))
    ]
