"""One rank of one experiment: `python -m distlab.rank.worker --job job.json` under torchrun
(or the same `run_rank` under accelerate launch / a Ray Train worker).

Loads the base model, applies LoRA if asked, lets the strategy wrap it, verifies the
result matches the spec, trains, and has rank 0 write metrics.json and steps.jsonl.
The pieces: distlab.rank.model_setup (build, LoRA, wrap, verify), distlab.rank.training_checkpoints
(resume and saves), distlab.rank.loop (the steps), distlab.runtime.memory (budget, OOM record),
distlab.rank.run_summary (what the run measured), distlab.records.run_outputs (the result files).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from distlab.runtime.activations import ActivationProbe
from distlab.configuration.training_tools import adapts
from distlab.runtime.evaluation import evaluate_run
from distlab.records.job import Job, read_job
from distlab.launchers.links import interface_counters
from distlab.rank.loop import gather, train
from distlab.runtime.memory import (OOM_EXIT_CODE, apply_memory_budget, budget_verdict, gather_peaks_through_save,
                                    is_out_of_memory, load_phase_record, memory_record, record_oom, rss_now,
                                    start_save_phase, with_peaks_through_save)
from distlab.rank.model_setup import prepare_model
from distlab.rank.monitor import RunMonitor
from distlab.runtime.noise import NoiseProbe
from distlab.runtime.compiled import compile_record, dynamo_counts
from distlab.runtime.profiling import StepProfiler, profile_record
from distlab.records.run_outputs import write_outputs
from distlab.rank.run_summary import gather_ranks, summarize_run
from distlab.strategies import strategy_for
from distlab.strategies.base import RunContext, local_device
from distlab.tasks import task_for
from distlab.runtime.timeline import Timeline
from distlab.runtime.tracking import hide_mlflow
from distlab.rank.training_checkpoints import TrainingCheckpoints
from distlab.runtime.unequal import enter_cpu_budget, leave_cpu_budget, rank_threads

TIMELINE = Timeline()
TIMELINE.mark("interpreter and imports")  # python start + torch, transformers, distlab


def make_context(job: Job) -> RunContext:
    spec = job.spec
    return RunContext(spec=spec, run_dir=job.run_dir, device=local_device(spec),
                      rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), job=job, task=task_for(spec))


def predicted_step_time(job: Job, since_start: NoiseProbe) -> dict:
    """The step time rank 0 predicts before the first step from the job's probe and collectives
    files (distlab.tools.step_time; the model's config.json for its shapes), and the cores other
    processes kept busy since the rank started (`since_start`: what else shares the machine
    with a run that leaves cores free). The job's other ranks are counted as using what rank 0
    used: they do the same work."""
    from distlab.tools.step_time import predict_from_files

    window = since_start.stop()
    others = None
    if window and window["machine_cpu_s"] is not None and window["wall_s"] > 0:
        ranks = job.spec.world_size * window["own_cpu_s"]
        others = max(0.0, window["machine_cpu_s"] - ranks) / window["wall_s"]
    config = os.path.join(job.model_source or "", "config.json")
    return predict_from_files(job.spec, config if os.path.isfile(config) else None, job.probe_json,
                              job.collectives_json, job.hardware_json, others)


def estimated_memory(job: Job, task) -> dict | None:
    """The advisor's memory estimate for this run's own spec, recorded by rank 0 before the
    first step (distlab.tools.advisor_check.estimate_record; the report's advisor card holds it
    to what the run measured): a task whose model the formulas size, its config.json on disk."""
    from distlab.runtime.parameter_counts import model_shape
    from distlab.tools.advisor_check import estimate_record

    config = os.path.join(job.model_source or "", "config.json")
    if not task.advisor_sized or not os.path.isfile(config):
        return None
    with open(config) as fh:
        return estimate_record(model_shape(json.load(fh)), job.spec)


class RankRun:
    """One rank's run, as torchtitan's Trainer reads: built once (the constructor: process group,
    model, data, checkpoints, and rank 0's predictions of step time and memory, made before the
    first step so the report can score them), trained (`train`), then finished (`finish`: the
    held-out evaluation, the record built at once, the final save).

    checkpoints_class: a TrainingCheckpoints subclass (the Ray launcher's reports to Ray)."""

    def __init__(self, job: Job, checkpoints_class=None):
        self.job, self.started = job, time.time()
        since_start = NoiseProbe()  # what else used the machine before the first step: the prediction's neighbours
        since_start.start()
        self.timeline = TIMELINE.after_imports()
        spec = job.spec
        if spec.device == "cpu":
            # On CPU a "device" is cpu_threads_per_rank cores, the same for every world size
            # (rank_cpu_threads: unequal CPU devices, one count per rank).
            torch.set_num_threads(rank_threads(spec, int(os.environ.get("RANK", 0))))
        self.ctx = ctx = make_context(job)
        self.budget = apply_memory_budget(ctx)
        self.strategy = strategy = strategy_for(spec)(ctx)
        strategy.init_distributed()
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
        self.timeline.mark("process group")
        self.profiler = StepProfiler(spec, job.run_dir, ctx.rank, ctx.device)  # profile: {steps: [a, b]}
        self.profiler.start()  # CUDA memory history from here, so an out-of-memory load is in it too

        strategy.task.import_code(job.model_source, adapts(spec))
        self.cpu_budget = enter_cpu_budget(spec, ctx.rank)  # rank_cpu_budget: a slower CPU device, load to last step
        rss_before_model = rss_now()  # interpreter + libraries + process group: what a rank costs before its model
        self.prepared = prepare_model(strategy, job.model_source, spec)
        self.timeline.mark("model load, wrap, verify")
        if self.cpu_budget is not None:  # what the kernel enforces on every rank, read back
            self.prepared.described["cpu_budget"] = gather(self.cpu_budget)
        self.train_data = strategy.task.train_data(job, spec, ctx.device)  # the task's samples and their batches
        self.prepared.described["task"] = self.train_data.describe()

        self.checkpoints = (checkpoints_class or TrainingCheckpoints)(job, ctx, strategy, self.prepared.signature,
                                                                      len(self.train_data))
        self.start_step = self.checkpoints.resume()
        # Progress, trackers and eval points between steps; the activation-memory probe on an untimed step.
        self.monitor = RunMonitor(job, ctx, strategy, self.checkpoints.records, self.start_step, self.checkpoints)
        self.probe = ActivationProbe(spec, ctx.rank, self.start_step)
        self.load_phase = load_phase_record(ctx.device, rss_before_model)  # process start -> first step
        self.predicted = {"prediction": predicted_step_time(job, since_start),
                          "memory_estimate": estimated_memory(job, strategy.task)} if ctx.is_main else {}
        self.timeline.mark("data, resume")

    def on_step_end(self, step: int) -> None:
        self.monitor.after_step(step)  # first: a checkpoint saved at this step holds its eval point
        self.checkpoints.on_step_end(step)

    def train(self) -> None:
        """The steps, then what every rank measured of them, gathered (a collective)."""
        spec, ctx, prepared = self.job.spec, self.ctx, self.prepared
        wire_before = interface_counters() if spec.link else None  # this host's link, around the steps
        result = train(ctx, self.strategy, self.train_data, start_step=self.start_step,
                       stream=self.checkpoints.stream, on_step_end=self.on_step_end, records=self.checkpoints.records,
                       micro_context=self.probe, profiler=self.profiler)
        self.timeline.mark("steps")
        self.profiles = gather(self.profiler.record)
        self.during = self.monitor.finish()
        leave_cpu_budget(self.cpu_budget)
        if wire_before is not None:  # bytes this rank's host sent and received during its steps
            wire = interface_counters()
            prepared.described["link_traffic"] = gather({k: wire[k] - wire_before[k] for k in wire})
        prepared.described.update(self.strategy.facts_after_training() or {}, train_mode=result["train_mode"])
        memory = memory_record(ctx, self.load_phase)
        memory["activations"] = self.probe.result
        memory["budget"] = budget_verdict(self.budget, memory, result["state_bytes"])
        self.ranks = gather_ranks(result, memory)
        self.timeline.mark("gather records")

    def finish(self) -> tuple[dict, list] | None:
        """The held-out evaluation, the record, the final save; rank 0 returns (metrics, step
        rows), the others None. The record is on disk before the final save, so a save that fails
        (or runs out of memory, distlab.jobs.launch.write_oom_metrics) cannot take the figures
        with it; the save's outcome and peaks then make the record that replaces it."""
        job, ctx = self.job, self.ctx
        reset_for_save = start_save_phase(ctx.device)  # the final evaluation, save and export measured alone
        # Collective: the trained model on the held-out data (a timing-only launch, spec launches, skips it).
        last_point = next((p for p in self.during["eval_points"] if p["steps_done"] == job.spec.steps), None)
        evaluation = None if job.timing_only else evaluate_run(self.strategy, job, last_point)
        self.timeline.mark("held-out eval")
        summary = None
        if ctx.is_main:
            summary = summarize_run(job, ctx, self.strategy, self.prepared, self.ranks, len(self.train_data),
                                    self.started)
            saving = {"status": "saving" if self.checkpoints.enabled else "off",
                      "note": "metrics.json was written before the final save; this record replaces it"}
            write_outputs(job.run_dir, self.record(summary, evaluation, saving))
        saved = self.checkpoints.save_final()
        self.timeline.mark("final save and export")
        peaks = gather_peaks_through_save(ctx.device, reset_for_save)  # collective
        if summary is None:
            return None
        return self.record(summary, evaluation, saved or {"status": "off", "reason": "the job names no checkpoint "
                                                                                     "folder"}, peaks)

    def record(self, summary: tuple[dict, list], evaluation: dict | None, checkpoint: dict,
               peaks: list | None = None) -> tuple[dict, list]:
        """metrics.json's dict and the step rows, built at once: what the ranks measured
        (summarize_run), rank 0's predictions, the held-out evaluation, the trackers, profiler
        traces, compile time, the checkpoint and, after the save, each rank's peaks through it."""
        metrics, steps = summary
        spec = self.job.spec
        timing = metrics["timing"]
        if spec.compile:
            compiled = compile_record(steps, self.start_step, self.ctx.untimed_steps, dynamo_counts())
            timing = {**timing, "compile": compiled}
        if evaluation is not None:
            evaluation = {**evaluation, "during_training": self.during["eval_points"],
                          **({"selected": self.during["selected"]} if "selected" in self.during else {})}
        return {**metrics, **self.predicted, "timing": timing,
                "memory": metrics["memory"] if peaks is None else with_peaks_through_save(metrics["memory"], peaks),
                "eval": evaluation, "tracking": self.during.get("tracking"), "profile": profile_record(self.profiles),
                "checkpoint": checkpoint, "timeline": self.timeline.record()}, steps


def run_rank(job: Job, checkpoints_class=None) -> tuple[dict, list] | None:
    """Everything one rank does; returns (metrics, step rows) on rank 0, None elsewhere."""
    run = RankRun(job, checkpoints_class)
    run.train()
    return run.finish()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True, help="job.json written by distlab.jobs.launch")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="accepted for the deepspeed launcher; LOCAL_RANK is used")
    args = parser.parse_args(argv)
    import faulthandler

    from distlab.launchers.process import die_with_parent
    from distlab.records.sharing import private_files

    # A rank killed by a signal from native code (SIGABRT: "terminate called without an active
    # exception", seen twice under load, cause unknown) leaves every thread's Python stack in its log.
    faulthandler.enable()

    die_with_parent(same_launch=True)  # a rank never outlives its launcher
    private_files()  # what this rank writes under results/ is not world-readable (distlab.records.sharing)
    job = read_job(args.job)
    # Only the rank that writes to MLflow imports it (DeepSpeed's import would otherwise pull it in).
    hide_mlflow(uses_it=int(os.environ.get("RANK", 0)) == 0 and "mlflow" in job.spec.tracking)
    try:
        summary = run_rank(job)
    except Exception as error:  # noqa: BLE001 - only allocation failures are handled; the rest re-raise
        if not is_out_of_memory(error):
            raise
        record_oom(job.run_dir, error)
        # Peers may be blocked in a collective: exit hard, torchrun tears the group down.
        os._exit(OOM_EXIT_CODE)
    if summary is not None:
        metrics, steps = summary
        write_outputs(job.run_dir, (metrics, steps))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()  # a finished rank skips the interpreter's teardown (~1.3 s of CPU)
