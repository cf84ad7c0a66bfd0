"""Fine-tuning controls, measured: activation checkpointing none / full / selective on the
same model (per-rank peak memory, saved activations vs the advisor's estimate, step time, loss
unchanged), the learning-rate schedules and gradient clipping the runs used, and held-out eval
during training."""
from __future__ import annotations

from distlab.report.cards import FAILED, NOT_RUN, PASSED, SPREAD_CAVEAT, Card, Figure, Goal, Table, metrics_link
from distlab.report.cards import finetune_tools
from distlab.report.plots import label_axes, to_png_b64
from distlab.report.report_run import ReportRun

MIB = 2**20
# fp32 activation checkpointing recomputes the same forward: the losses must not move.
LOSS_TOLERANCE = 1e-6
GOAL_AC = "Activation checkpointing none / full / selective measured on the same model, loss unchanged"
GOAL_SCHEDULE = "Learning-rate schedule and gradient clipping recorded per step"
GOAL_EVAL = "Held-out loss during training (eval_every)"
# Spec keys that may differ inside an activation-checkpointing group (the rest must match).
AC_KEYS = ("id", "tag", "activation_checkpointing", "activation_checkpointing_every", "tracking",
           "progress_every_s", "eval_every", "checkpoint_select", "checkpoint_every", "repeats")


def twin_groups(runs: list[ReportRun], free_keys: tuple, variant) -> list[dict]:
    """{variant(run): run} per group of ok runs on one machine whose specs match outside
    free_keys; runs whose variant is None are left out."""
    groups: dict = {}
    for run in runs:
        if run.status != "ok" or variant(run) is None:
            continue
        key = (run.machine, repr(sorted((k, repr(v)) for k, v in run.spec.items() if k not in free_keys)))
        groups.setdefault(key, {})[variant(run)] = run
    return list(groups.values())


def ac_groups(runs: list[ReportRun]) -> list[dict]:
    """{mode: run} per group of ok runs that differ only in activation checkpointing, with a
    'none' run and at least one other mode."""
    groups = twin_groups(runs, AC_KEYS, lambda run: (run.spec.activation_checkpointing or "none"))
    return [g for g in groups if "none" in g and len(g) > 1]


def peak_per_rank(run: ReportRun) -> list[float | None]:
    out = []
    for rank in (run.memory or {}).get("per_rank") or []:
        phase = rank.get("training_phase") or {}
        value = phase.get("cuda_max_reserved_bytes") or phase.get("rss_peak_bytes")
        out.append(round(value / MIB, 1) if value else None)
    return out


def ac_rows(group: dict) -> tuple[list[dict], float]:
    base = group["none"].loss.per_step
    rows, worst = [], 0.0
    for mode in ("none", "selective", "full"):
        run = group.get(mode)
        if run is None:
            continue
        diff = max(abs(a - b) for a, b in zip(base, run.loss.per_step))
        worst = max(worst, diff)
        st = run.timing.step_time_s
        saved = [((m.get("activations") or {}).get("bytes")) for m in run.memory.per_rank]
        rows.append({"mode": mode, "experiment": run.experiment,
                     "layers checkpointed (rank 0)": str(run.as_built.get("activation_checkpointing", {})
                                                          .get("checkpointed")),
                     "peak memory per rank (MiB)": ", ".join(str(p) for p in peak_per_rank(run)),
                     "saved activations per rank (MiB)": ", ".join(f"{b / MIB:.2f}" if b else "n/a" for b in saved),
                     "median step (ms)": round(st.median * 1000, 1),
                     "step p25-p75 (ms)": f"{st.p25 * 1000:.1f}-{st.p75 * 1000:.1f}",
                     "max |loss - none|": f"{diff:.1e}"})
    return rows, worst


def activation_goal(card: Card, runs: list[ReportRun]) -> None:
    import pandas as pd

    groups = ac_groups(runs)
    if not groups:
        card.goals.append(Goal("minimal", GOAL_AC, NOT_RUN, "needs runs that differ only in "
                               "activation_checkpointing, one of them none"))
        return
    rows, worst, saved_ok, links = [], 0.0, True, []
    for group in groups:
        group_rows, group_worst = ac_rows(group)
        rows += group_rows
        worst = max(worst, group_worst)
        saved = {m: (r.memory.per_rank[0].get("activations") or {}).get("bytes") for m, r in group.items()}
        saved_ok &= all(saved[m] is not None and saved[m] < saved["none"] for m in saved if m != "none")
        links += [metrics_link(r) for r in group.values()]
    ok = worst <= LOSS_TOLERANCE and saved_ok
    card.goals.append(Goal("minimal", GOAL_AC, PASSED if ok else FAILED,
                           f"{len(groups)} group(s); largest |loss - none| {worst:.1e} (limit {LOSS_TOLERANCE:.0e}); "
                           f"saved activations {'below' if saved_ok else 'NOT below'} the none run's in every "
                           "checkpointed run", links))
    how = ("peak memory: each rank's training-phase peak (CUDA allocator reserved, else VmHWM); saved activations: "
           "bytes autograd held at the end of one micro-batch's forward (distlab.runtime.activations.ActivationProbe; "
           "the advisor's estimate of the same figure is in the advisor card's check table); step time: median over "
           f"the timed steps (max over ranks); {SPREAD_CAVEAT}")
    card.tables.append(Table("Activation checkpointing: memory and time per mode", pd.DataFrame(rows), how))


def schedule_goal(card: Card, runs: list[ReportRun]) -> None:
    scheduled = [r for r in runs if r.status == "ok" and (r.optimization or {}).get("lr_per_step")
                 and ((r.spec.lr_schedule or "constant") != "constant" or r.spec.max_grad_norm)]
    if not scheduled:
        card.goals.append(Goal("bonus", GOAL_SCHEDULE, NOT_RUN, "no run with a decaying schedule or clipping"))
        return
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8.5, 3.2))
    for run in scheduled:
        opt = run.optimization
        ax.plot(opt.lr_per_step, label=run.experiment, linewidth=1.1)
        ax2.plot(opt.grad_norm_per_step, label=run.experiment, linewidth=1.1)
    clip = sorted({r.spec.max_grad_norm for r in scheduled if r.spec.max_grad_norm})
    for value in clip:
        ax2.axhline(value, color="grey", linestyle="--", linewidth=0.8)
    label_axes(ax, "optimizer step", "learning rate", "Learning rate per step")
    label_axes(ax2, "optimizer step", "pre-clip gradient norm", "Global gradient norm (dashed: max_grad_norm)")
    card.figures.append(Figure("Learning rate and gradient norm", to_png_b64(fig),
                               "lr read from the optimizer before each step (transformers.get_scheduler); grad norm: "
                               "global L2 norm before clipping (distlab.runtime.clipping)"))
    clipped = sum(1 for r in scheduled for n in r.optimization.grad_norm_per_step
                  if n is not None and r.spec.max_grad_norm and n > r.spec.max_grad_norm)
    card.goals.append(Goal("bonus", GOAL_SCHEDULE, PASSED,
                           f"{len(scheduled)} run(s); {clipped} step(s) clipped (pre-clip norm above max_grad_norm)",
                           [metrics_link(r) for r in scheduled]))


def eval_goal(card: Card, runs: list[ReportRun]) -> None:
    evaluated = [r for r in runs if r.status == "ok" and (r.section("eval") or {}).get("during_training")]
    if not evaluated:
        card.goals.append(Goal("bonus", GOAL_EVAL, NOT_RUN, "no run set eval_every"))
        return
    best = [r for r in evaluated if (r.section("eval").get("selected") or {}).get("checkpoint")]
    points = sum(len(r.section("eval").during_training) for r in evaluated)
    card.goals.append(Goal("bonus", GOAL_EVAL, PASSED,
                           f"{len(evaluated)} run(s), {points} eval points (plotted on each stage's loss curves); "
                           f"{len(best)} kept their best checkpoint (checkpoint_select: best)",
                           [metrics_link(r) for r in evaluated]))


GOAL_PACKING = "Packing documents vs one row per sequence: label tokens/s on the same rows"
# Spec keys that may differ between the two runs of a packing pair (the rest must match).
PACKING_KEYS = ("id", "tag", "dataset", "checkpoint_select", "checkpoint_every", "eval_every", "tracking",
                "progress_every_s", "repeats")


def packing_pairs(runs: list[ReportRun]) -> list[dict]:
    """{packing: run} per group of ok runs that differ only in their dataset (and bookkeeping),
    one on rows packed as documents and one on rows one per sequence (data.packing none)."""
    def packing(run):
        mode = (run.section("data_prep") or {}).get("packing")
        return mode if mode in ("documents", "none") else None

    return [g for g in twin_groups(runs, PACKING_KEYS, packing) if len(g) == 2]


def label_tokens_per_s(run: ReportRun) -> float:
    """Label (trained) tokens per second: the run's trained tokens per step over its median step time."""
    steps = len(run.loss.per_step)
    return run.section("data_prep").run_tokens.trained / steps / run.timing.step_time_s.median


def packing_goal(card: Card, runs: list[ReportRun]) -> None:
    import pandas as pd

    pairs = packing_pairs(runs)
    if not pairs:
        card.goals.append(Goal("bonus", GOAL_PACKING, NOT_RUN, "needs two runs that differ only in a dataset "
                               "packed as documents and one with packing none"))
        return
    rows, gains = [], []
    for pair in pairs:
        rates = {mode: label_tokens_per_s(run) for mode, run in pair.items()}
        gains.append(rates["documents"] / rates["none"])
        for mode in ("documents", "none"):
            run = pair[mode]
            trained = (run.section("eval") or {}).get("trained") or {}
            rows.append({"packing": mode, "experiment": run.experiment,
                         "label tokens/s": round(rates[mode], 1),
                         "sequence positions/s": round(run.throughput.tokens_per_s, 1)
                         if (run.throughput or {}).get("tokens_per_s") else "n/a",
                         "median step (ms)": round(run.timing.step_time_s.median * 1000, 1),
                         "last loss": round(run.loss.last, 4),
                         "held-out loss": round(trained["loss"], 4) if isinstance(trained.get("loss"), float)
                         else "n/a"})
    card.goals.append(Goal("bonus", GOAL_PACKING, PASSED,
                           f"{len(pairs)} pair(s); documents trains on " + ", ".join(f"{g:.2f}x" for g in gains)
                           + " the label tokens per second of one row per sequence",
                           [metrics_link(r) for pair in pairs for r in pair.values()]))
    how = ("label tokens/s: the label positions the run trained on (data_prep.run_tokens.trained, after the causal "
           "shift, -100 excluded) per step over the median step time (max over ranks); sequence positions/s counts "
           "padding too (throughput.tokens_per_s). Both runs read the same rows (data.packing documents vs none, "
           f"distlab/data_prep/packing.py); {SPREAD_CAVEAT}")
    card.tables.append(Table("Packing: documents vs one row per sequence", pd.DataFrame(rows), how))


def build(runs: list[ReportRun]) -> Card:
    card = Card(7, "Fine-tuning controls - activation checkpointing, schedules, clipping, eval")
    activation_goal(card, runs)
    schedule_goal(card, runs)
    eval_goal(card, runs)
    packing_goal(card, runs)
    finetune_tools.qlora_goal(card, runs)
    finetune_tools.compile_goal(card, runs)
    finetune_tools.profile_goal(card, runs)
    return card
