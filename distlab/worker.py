"""One rank of one experiment: `python -m distlab.worker --job job.json` under torchrun
(or the same `run_rank` under accelerate launch / a Ray Train worker).

Loads the base model, applies LoRA if asked, lets the strategy wrap it, verifies the
result matches the spec, trains, and has rank 0 write metrics.json and steps.jsonl.
The pieces: distlab.model_setup (build, LoRA, wrap, verify), distlab.training_checkpoints
(resume and saves), distlab.loop (the steps), distlab.memory (budget, OOM record),
distlab.run_summary (what the run measured), distlab.run_outputs (the result files).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.activations import ActivationProbe
from distlab.data import load_blocks, load_labels
from distlab.evaluation import evaluate_run
from distlab.loop import train
from distlab.memory import (OOM_EXIT_CODE, add_peaks_through_save, apply_memory_budget, budget_verdict,
                            gather_peaks_through_save, is_out_of_memory, load_phase_record, memory_record,
                            record_oom, rss_now)
from distlab.model import import_model_code
from distlab.model_setup import prepare_model
from distlab.monitor import RunMonitor
from distlab.run_outputs import write_outputs
from distlab.run_summary import gather_ranks, summarize_run
from distlab.strategies import strategy_for
from distlab.strategies.base import RunContext, local_device
from distlab.training_checkpoints import TrainingCheckpoints


def make_context(job: dict) -> RunContext:
    spec = job["spec"]
    return RunContext(spec=spec, run_dir=job["run_dir"], device=local_device(spec),
                      rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), job=job)


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

    import_model_code(job["model_source"], spec["method"] == "lora")
    rss_before_model = rss_now()  # interpreter + libraries + process group: what a rank costs before its model
    prepared = prepare_model(strategy, job["model_source"], spec)
    train_blocks = load_blocks(job["data_dir"], "train")
    if train_blocks.shape[1] != spec["seq_len"]:
        raise ValueError(f"data blocks are {train_blocks.shape[1]} tokens, spec seq_len is {spec['seq_len']}")

    checkpoints = (checkpoints_class or TrainingCheckpoints)(job, ctx, strategy, prepared.signature,
                                                             len(train_blocks))
    start_step = checkpoints.resume()
    # Progress, trackers and eval points between steps; the activation-memory probe on an untimed step.
    monitor = RunMonitor(job, ctx, strategy, checkpoints.records, start_step, checkpoints)
    probe = ActivationProbe(spec, ctx.rank, start_step)

    def on_step_end(step: int) -> None:
        monitor.after_step(step)  # first: a checkpoint saved at this step holds its eval point
        checkpoints.on_step_end(step)

    load_phase = load_phase_record(ctx.device, rss_before_model)  # process start -> first step
    result = train(ctx, strategy, train_blocks, start_step=start_step, stream=checkpoints.stream,
                   on_step_end=on_step_end, records=checkpoints.records,
                   train_labels=load_labels(job["data_dir"], "train"), micro_context=probe)
    during = monitor.finish()
    prepared.described.update(strategy.facts_after_training() or {})
    memory = memory_record(ctx, load_phase)
    memory["activations"] = probe.result
    memory["budget"] = budget_verdict(budget, memory, result["state_bytes"])

    ranks = gather_ranks(result, memory)
    evaluation = evaluate_run(strategy, job)  # collective: the trained model on the held-out tokens
    out = summarize_run(job, ctx, strategy, prepared, ranks, len(train_blocks), started) if ctx.is_main else None
    saved = checkpoints.save_final()
    peaks_through_save = gather_peaks_through_save(ctx.device)  # collective: eval, save and export included
    if out is not None:
        out[0]["checkpoint"] = saved
        out[0]["eval"] = {**evaluation, "during_training": during["eval_points"]}
        if "selected" in during:
            out[0]["eval"]["selected"] = during["selected"]
        out[0]["tracking"] = during.get("tracking")
        add_peaks_through_save(out[0]["memory"], peaks_through_save)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="job.json written by distlab.launch")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="accepted for the deepspeed launcher; LOCAL_RANK is used")
    args = parser.parse_args(argv)
    import faulthandler

    from distlab.launchers.process import die_with_parent

    # A rank killed by a signal from native code (SIGABRT: "terminate called without an active
    # exception", seen twice under load, cause unknown) leaves every thread's Python stack in its log.
    faulthandler.enable()

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
