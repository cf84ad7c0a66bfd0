"""Stage 2 - Hugging Face Accelerate: a LoRA fine-tune, single vs multi process switched by
the Accelerate config file alone, and gradient accumulation vs throughput.

Every figure comes from the runs' metrics.json: what Accelerate reported at run time
(as_built.accelerate), the config file the launch read (as_built.accelerate.launched_with) and
the counters the strategy kept (micro-batches, gradient syncs, optimizer steps taken).
"""
from __future__ import annotations

import math

from matplotlib.ticker import ScalarFormatter

from distlab.report.held_out import eval_sentence
from distlab.report.cards import (FAILED, NOT_RUN, PASSED, Card, Figure, Goal, Table, comm_ms, metrics_link,
                                  ok_runs, tokens_per_s)
from distlab.report.plots import figure, label_axes, loss_curves, to_png_b64
from distlab.records.run_layout import run_files_dir
from distlab.report.report_run import ReportRun

# Its lesson (cards.parity.lesson_goal): the stage, and whether its runs must train what DDP trains.
LESSON = ("accelerate", False)

STAGE = "accelerate"


def _accelerate_record(run) -> dict:
    return (run.as_built or {}).get("accelerate") or {}


def _counts(run) -> dict:
    return _accelerate_record(run).get("counts") or {}


def accelerate_runs(runs: list[ReportRun]) -> list[ReportRun]:
    """Successful stage-2 runs that the Accelerate strategy really ran."""
    return [r for r in ok_runs(runs, STAGE) if r.spec.strategy == "accelerate" and _accelerate_record(r)]


def stepped_as_asked(run) -> str | None:
    """Why the run's own counters disagree with its spec, or None when they agree."""
    # A run resumed from a checkpoint counted only the steps it trained after the resume.
    resumed = (run.section("checkpoint") or {}).get("resumed_from_steps") or 0
    counts, steps = _counts(run), run.spec.steps - resumed
    if counts.get("optimizer_steps_taken") != steps:
        return f"{counts.get('optimizer_steps_taken')} optimizer steps taken of {steps}"
    if counts.get("gradient_syncs") != steps:
        return f"{counts.get('gradient_syncs')} gradient syncs for {steps} optimizer steps"
    if counts.get("micro_batches") != steps * run.spec.grad_accum:
        return f"{counts.get('micro_batches')} micro-batches for {steps} steps x ga {run.spec.grad_accum}"
    return None


def config_pairs(runs: list[ReportRun]) -> list[tuple[ReportRun, ReportRun]]:
    """(1-process run, N-process run) pairs whose specs are identical but for world_size:
    everything else that differed between them was the Accelerate config file."""
    pairs = []
    for one in runs:
        if one.spec.world_size != 1 or not _accelerate_record(one).get("launched_with"):
            continue
        for multi in runs:
            if multi.machine != one.machine or multi.spec.world_size < 2:
                continue
            if not _accelerate_record(multi).get("launched_with"):
                continue
            a = {k: v for k, v in one.spec.items() if k not in ("id", "world_size")}
            b = {k: v for k, v in multi.spec.items() if k not in ("id", "world_size")}
            if a == b:
                pairs.append((one, multi))
    return pairs


def pair_links(one: ReportRun, multi: ReportRun) -> list[str]:
    """Evidence of a 1 vs N pair: both metrics.json and both Accelerate config files."""
    return [metrics_link(one), metrics_link(multi), str(run_files_dir(one.folder) / "accelerate_config.yaml"),
            str(run_files_dir(multi.folder) / "accelerate_config.yaml")]


def accumulation_groups(runs: list[ReportRun]) -> dict:
    """Runs that differ only in grad_accum (same machine, micro batch, ranks, method, ...)."""
    groups = {}
    for run in runs:
        s = run.spec
        key = (run.machine, s.method, s.world_size, s.micro_batch, s.seq_len, s.precision,
               s.device, s.steps)
        groups.setdefault(key, {})[s.grad_accum] = run
    return {k: v for k, v in groups.items() if len(v) >= 2}


def lora_goal(runs: list[ReportRun], accel: list[dict]) -> Goal:
    text = "Accelerate LoRA fine-tune ran"
    lora = [r for r in accel if r.spec.method == "lora"]
    good = [r for r in lora if stepped_as_asked(r) is None and math.isfinite(r.loss.last or math.nan)]
    if good:
        run = max(good, key=lambda r: r.as_built.world_size)
        facts, params = _accelerate_record(run), run.section("parameters")
        return Goal("minimal", text, PASSED,
                    f"{run.experiment} on {run.machine}: Accelerate {facts.distributed_type}, "
                    f"{facts.num_processes} process(es), model wrapped by {run.as_built.wrapped_by}; "
                    f"{params.trainable:,} of {params.total:,} parameters trainable "
                    f"({params.trainable_fraction:.1%}, targets {', '.join(run.section('lora_targets') or [])}); "
                    f"{_counts(run)['optimizer_steps_taken']} optimizer steps, loss {run.loss.first:.3f} -> "
                    f"{run.loss.last:.3f}", [metrics_link(r) for r in good])
    tried = [r for r in runs if r.stage == STAGE and r.spec.method == "lora"]
    if lora:
        return Goal("minimal", text, FAILED, "; ".join(f"{r.experiment}: {stepped_as_asked(r)}" for r in lora),
                    [metrics_link(r) for r in lora])
    if tried:
        return Goal("minimal", text, FAILED, "; ".join(f"{r.experiment}: status {r.status}" for r in tried),
                    [metrics_link(r) for r in tried])
    return Goal("minimal", text, NOT_RUN, "no Accelerate LoRA experiment in the results")


def switch_goal(card: Card, pairs) -> None:
    text = "Switch single/multi device by the Accelerate config file alone"
    if not pairs:
        card.goals.append(Goal("minimal", text, NOT_RUN,
                               "needs two Accelerate runs whose specs differ only in world_size (1 and N)"))
        return
    import pandas as pd

    rows, verdicts = [], []
    for one, multi in pairs:
        real = (one.as_built.world_size, multi.as_built.world_size)
        ok = real == (1, multi.spec.world_size)
        verdicts.append(ok)
        for run in (one, multi):
            facts, launched = _accelerate_record(run), _accelerate_record(run)["launched_with"]
            st = run.timing.step_time_s
            median, low, high = tokens_per_s(run)
            rows.append({"machine": run.machine, "experiment": run.experiment,
                         "config file": f"{launched.path} (sha256 {launched.sha256[:10]})",
                         "config distributed_type": launched.distributed_type,
                         "config num_processes": launched.num_processes,
                         "Accelerate reported": facts.distributed_type,
                         "real world size": run.as_built.world_size, "wrapped by": run.as_built.wrapped_by,
                         "median step (ms)": round(st.median * 1000, 1),
                         "tokens/s (spread)": f"{median:.0f} ({low:.0f}-{high:.0f})",
                         "loss first -> last": f"{run.loss.first:.3f} -> {run.loss.last:.3f}"})
    one, multi = pairs[0]
    card.goals.append(Goal(
        "minimal", text, PASSED if all(verdicts) else FAILED,
        f"{one.experiment} and {multi.experiment} have the same spec except world_size; their config files "
        f"asked for {_accelerate_record(one)['launched_with']['num_processes']} and "
        f"{_accelerate_record(multi)['launched_with']['num_processes']} processes and the runs recorded real "
        f"world sizes "
        f"{one.as_built.world_size} and {multi.as_built.world_size} (Accelerate: "
        f"{_accelerate_record(one)['distributed_type']}, {_accelerate_record(multi)['distributed_type']})",
        pair_links(one, multi)))
    card.tables.append(Table("Single vs multi process: only the Accelerate config file changed", pd.DataFrame(rows),
                             "config columns: the file `accelerate launch` read, as the ranks found it; reported "
                             "columns: Accelerator.distributed_type and torch.distributed world size at run time; "
                             "tokens/s = global tokens per step / median step time (max over ranks) after warm-up"))


def accumulation_goal(card: Card, groups: dict) -> None:
    text = "Gradient accumulation vs throughput (plot + table)"
    if not groups:
        card.goals.append(Goal("bonus", text, NOT_RUN,
                               "needs Accelerate runs that differ only in grad_accum (same micro batch)"))
        return
    import pandas as pd

    fig, ax = figure()
    rows, problems = [], []
    for (machine, method, world, micro, seq, precision, device, steps), group in groups.items():
        gas = sorted(group)
        stats = [tokens_per_s(group[ga]) for ga in gas]
        medians = [s[0] for s in stats]
        errors = [[m - s[1] for m, s in zip(medians, stats)], [s[2] - m for m, s in zip(medians, stats)]]
        ax.errorbar(gas, medians, yerr=errors, marker="o", capsize=3,
                    label=f"{machine} {method} {world} ranks, micro-batch {micro}")
        for ga in gas:
            run = group[ga]
            why = stepped_as_asked(run)
            if why:
                problems.append(f"{run.experiment}: {why}")
            counts, st, cov = _counts(run), run.timing.step_time_s, run.section("data")
            measured_micro = cov.per_rank_reads[0] / (micro * steps)
            rows.append({"machine": machine, "ranks": world, "micro batch": micro, "grad accum": ga,
                         "global batch": run.throughput.samples_per_step,
                         "micro-batches per step (measured)": round(measured_micro, 2),
                         "optimizer steps taken": counts.get("optimizer_steps_taken"),
                         "gradient syncs": counts.get("gradient_syncs"),
                         "all-reduce calls": counts.get("allreduce_calls"),
                         "median step (ms)": round(st.median * 1000, 1),
                         "step p25-p75 (ms)": f"{st.p25 * 1000:.1f}-{st.p75 * 1000:.1f}",
                         "tokens/s": round(tokens_per_s(run)[0], 1),
                         "vs ga 1": round(tokens_per_s(run)[0] / medians[0], 3) if gas[0] == 1 else None,
                         "all-reduce in flight (ms/step)": comm_ms(run)})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({ga for g in groups.values() for ga in g}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    label_axes(ax, "gradient accumulation steps (micro-batches per optimizer step)", "tokens/s (global)",
               "Accelerate: gradient accumulation vs throughput")
    how = ("tokens/s = global tokens per optimizer step / median step time (max over ranks) after warm-up, "
           "error bars the spread; optimizer steps taken counted by a post-step hook on the torch optimizer, "
           "gradient syncs = micro-batches on which Accelerate's sync_gradients was true, all-reduce calls "
           "counted by a DDP communication hook, micro-batches per step from the sample indices each rank read")
    card.figures.append(Figure("Gradient accumulation vs throughput", to_png_b64(fig), how))
    card.tables.append(Table("Gradient accumulation sweep", pd.DataFrame(rows), how))
    group = next(iter(groups.values()))
    lo, hi = min(group), max(group)
    evidence = (f"ga {lo} -> {hi}: {tokens_per_s(group[lo])[0]:.0f} -> {tokens_per_s(group[hi])[0]:.0f} tokens/s; "
                f"each run took exactly its {group[lo].spec.steps} optimizer steps with one gradient sync each")
    card.goals.append(Goal("bonus", text, FAILED if problems else PASSED,
                           "; ".join(problems) if problems else evidence,
                           [metrics_link(r) for g in groups.values() for r in g.values()]))


def build(runs: list[ReportRun]) -> Card:
    card = Card(2, "Stage 2 - Hugging Face Accelerate")
    accel = accelerate_runs(runs)
    card.goals.append(lora_goal(runs, accel))
    switch_goal(card, config_pairs(accel))
    accumulation_goal(card, accumulation_groups(accel))
    relabelled = [r for r in accel if (_accelerate_record(r).get("launched_with") or {}).get("distributed_type")
                  not in (None, _accelerate_record(r)["distributed_type"])]
    if relabelled:
        seen = sorted({(_accelerate_record(r)["launched_with"]["distributed_type"],
                        _accelerate_record(r)["distributed_type"])
                       for r in relabelled})
        card.notes.append(
            f"Config file vs Accelerate at run time ({', '.join(r.experiment for r in relabelled)}): "
            f"{'; '.join(f'file {a}, Accelerate reported {b}' for a, b in seen)}. On one machine Accelerate "
            "starts N local ranks only through its torchrun-based launcher, which distributed_type MULTI_GPU "
            "selects; a MULTI_CPU file starts a single process (CPU ranks are spawned through mpirun). So for "
            "CPU ranks distlab writes MULTI_GPU with use_cpu: true, and each run verified the type and process "
            "count Accelerate reported.")
    if accel:
        card.figures.append(Figure("Loss curves", loss_curves(accel, "Stage 2 loss"),
                                   "mean training loss over data-parallel ranks per optimizer step"))
    card.notes.append(eval_sentence([r for r in runs if r.stage == "accelerate"]))  # base vs tuned eval loss
    return card
