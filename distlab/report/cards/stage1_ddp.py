"""Stage 1 - PyTorch DDP with torchrun: 1 vs N ranks, DistributedSampler, gradient sync."""
from __future__ import annotations

from distlab.report.held_out import eval_sentence
from distlab.report.cards import (DOUBTFUL, FAILED, NOT_RUN, PASSED, Card, Figure, Goal, Table, comm_ms,
                                  load_cell, metrics_link, noise_cause, ok_runs, plain_speed, spread_caveat)
from distlab.report.collect import clear_winner
from distlab.report.plots import figure, label_axes, loss_curves, to_png_b64
from distlab.report.report_run import ReportRun

# Its lesson (cards.parity.lesson_goal): the stage, and whether its runs must train what DDP trains.
LESSON = ("ddp", False)


def scaling_groups(runs):
    """Runs that differ only in world size (same machine, model shape, seq_len, method,
    sampler on, nothing else that changes the step's speed: plain_speed): the honest 1-vs-N
    comparison."""
    groups = {}
    for run in runs:
        s = run.spec
        # Activation checkpointing and compile change the step itself: their runs are the
        # fine-tuning card's, against their own twins.
        if s.sampler != "distributed" or s.strategy != "ddp" or not plain_speed(run):
            continue
        key = (run.machine, s.method, s.seq_len, s.micro_batch * s.grad_accum * s.world_size,
               s.precision, s.device)
        groups.setdefault(key, {})[s.world_size] = run
    return {k: v for k, v in groups.items() if 1 in v and len(v) > 1}


def loss_parity(group: dict) -> float:
    base = group[1].loss.per_step
    worst = 0.0
    for world, run in group.items():
        other = run.loss.per_step
        n = min(len(base), len(other))
        worst = max([worst] + [abs(a - b) for a, b in zip(base[:n], other[:n])])
    return worst


def speedup_goal(groups: dict) -> Goal:
    """The speedup graph's goal: passed with its figures, or doubtful where a speedup is above
    linear (N ranks cannot do more than N times one rank's work), with the likely cause."""
    first = next(iter(groups.values()))
    top = max(first)
    speedup = first[top].throughput.tokens_per_s / first[1].throughput.tokens_per_s
    links = [metrics_link(first[w]) for w in sorted(first)]
    text = f"{len(groups)} comparison(s); e.g. {top} ranks: {speedup:.2f}x the 1-rank tokens/s"
    if speedup > top:
        return Goal("bonus", "Speedup graph 1 vs 2 ranks", DOUBTFUL,
                    f"{text}: ABOVE LINEAR ({top} ranks cannot do more than {top}x one rank's work with the same "
                    f"global batch), so this is not a real gain; {noise_cause([first[1], first[top]])}", links)
    return Goal("bonus", "Speedup graph 1 vs 2 ranks", PASSED, text, links)


def build(runs: list[ReportRun]) -> Card:
    card = Card(1, "Stage 1 - PyTorch DDP with torchrun")
    ddp = [r for r in ok_runs(runs, "ddp") if r.spec.strategy == "ddp"]
    multi = [r for r in ddp if r.as_built.world_size >= 2
             and r.as_built.outer_wrapper == "DistributedDataParallel"]
    if multi:
        best = max(multi, key=lambda r: r.as_built.world_size)
        med = best.timing.step_time_s.median
        card.goals.append(Goal("minimal", "DDP training ran on 2+ ranks, time measured", PASSED,
                               f"{best.experiment} on {best.machine}: {best.as_built.world_size} ranks "
                               f"({best.as_built.backend}), median step {med * 1000:.1f} ms over "
                               f"{best.timing.step_time_s.n} timed steps", [metrics_link(best)]))
    else:
        status = FAILED if ddp else NOT_RUN
        card.goals.append(Goal("minimal", "DDP training ran on 2+ ranks, time measured", status,
                               "no successful DDP run with world size >= 2"))

    groups = scaling_groups(ddp)
    if groups:
        fig, ax = figure()
        rows = []
        for (machine, method, seq, gbs, precision, device), group in groups.items():
            worlds = sorted(group)
            tps = [group[w].throughput.tokens_per_s for w in worlds]
            ax.plot(worlds, [t / tps[0] for t in tps], marker="o", label=f"{machine} gbs={gbs} seq={seq}")
            for w in worlds:
                run = group[w]
                st = run.timing.step_time_s
                rows.append({"machine": machine, "ranks": w, "global batch": gbs,
                             "median step (ms)": round(st.median * 1000, 1),
                             "step p25-p75 (ms)": f"{st.p25 * 1000:.1f}-{st.p75 * 1000:.1f}",
                             "tokens/s": round(run.throughput.tokens_per_s, 1),
                             "speedup vs 1 rank": round(run.throughput.tokens_per_s / tps[0], 3),
                             "all-reduce in flight (ms/step)": comm_ms(run),
                             "vs 1 rank": "-" if w == 1 else (
                                 "no clear winner" if not clear_winner(run, group[1]) else
                                 "faster" if run.throughput.tokens_per_s > tps[0] else "slower"),
                             "max loss diff vs 1 rank": f"{loss_parity({1: group[1], w: run}):.2e}",
                             "machine during timing": load_cell(run)})
        top = max(worlds)
        ax.plot([1, top], [1, top], linestyle="--", color="grey", label="linear")
        label_axes(ax, "ranks", "throughput / 1-rank throughput", "DDP speedup, same global batch")
        how = ("tokens/s = global tokens per step / median step time (max over ranks) after warm-up; "
               "same model, data, seed and global batch at each rank count; 'no clear winner' when the "
               f"throughput spreads overlap; {spread_caveat([r for g in groups.values() for r in g.values()])}")
        card.figures.append(Figure("Speedup 1 vs N ranks", to_png_b64(fig), how))
        import pandas as pd

        card.tables.append(Table("1 vs N ranks", pd.DataFrame(rows), how))
        card.goals.append(speedup_goal(groups))
    else:
        card.goals.append(Goal("bonus", "Speedup graph 1 vs 2 ranks", NOT_RUN,
                               "needs a 1-rank and a 2+-rank DDP run with the same global batch"))

    for run in ddp:
        if run.spec.sampler == "none":
            cov = run.section("data")
            card.notes.append(
                f"Without DistributedSampler ({run.experiment}): {cov.duplicate_reads} of {cov.reads} "
                f"sample reads were duplicates ({cov.duplicate_fraction:.0%}); every rank read the same "
                f"{cov.samples_read_by_every_rank} samples, so {run.as_built.world_size} ranks did the work "
                "of one.")
        elif run.as_built.world_size > 1:
            cov = run.section("data")
            card.notes.append(
                f"With DistributedSampler ({run.experiment}): {cov.duplicate_reads} duplicate reads of "
                f"{cov.reads}; the epoch plan is {'disjoint' if cov.epoch_plan_disjoint else 'NOT disjoint'} "
                f"across ranks and covers {cov.epoch_plan_covered} of {cov.epoch_size} samples "
                f"({cov.epoch_plan_dropped} dropped to keep shards equal).")
    if ddp:
        card.figures.append(Figure("Loss curves", loss_curves(ddp, "Stage 1 loss"),
                                   "mean training loss over data-parallel ranks per optimizer step"))
    card.notes.append(eval_sentence([r for r in runs if r.stage == "ddp"]))  # base vs tuned eval loss
    return card
