"""The unequal-devices card (`snakemake unequal`): DDP on ranks of different speed, uniform
micro-batches against batches sized per rank (distlab/runtime/unequal.py). Not a `stage*` module: its
own page shows it, and the advisor cites its card.json."""
from __future__ import annotations

import json

from distlab.report.cards import FAILED, NOT_RUN, PASSED, SPREAD_CAVEAT, Card, Figure, Goal, Table, metrics_link
from distlab.report.collect import clear_winner
from distlab.report.plots import figure, label_axes, to_png_b64
from distlab.report.report_run import ReportRun

SIZING_KEYS = ("rank_micro_batch", "id", "tag")


def device_key(run: ReportRun) -> str:
    """What makes the devices unequal, and everything else but the batch split."""
    spec = {k: v for k, v in run.spec.items() if k not in SIZING_KEYS}
    return json.dumps(spec, sort_keys=True)


def devices(run: ReportRun) -> str:
    spec = run.spec
    budget = run.as_built.get("cpu_budget")
    cores = [b["cores"] for b in budget] if budget else None
    threads = spec.rank_cpu_threads or [spec.cpu_threads_per_rank] * spec.world_size
    return " / ".join(f"rank {r}: {threads[r]} thread(s)" + (f", {cores[r]:g} core(s) of CPU time" if cores else "")
                      for r in range(spec.world_size))


def sizes(run: ReportRun) -> list[int]:
    sized = run.as_built.get("rank_micro_batch")
    return sized["sizes"] if sized else [run.spec.micro_batch] * run.spec.world_size


def waits(run: ReportRun) -> list[float | None]:
    return [r["comm_inflight_s_median"] for r in run.section("timing_per_rank") or []]


def idle_ms(run: ReportRun) -> str:
    """Per rank: its all-reduce time in flight beyond the least of any rank (time spent waiting
    for a slower peer; the least is the transfer itself)."""
    found = waits(run)
    if not found or None in found:
        return "not measured"
    return " / ".join(f"{(w - min(found)) * 1e3:.0f}" for w in found)


def build(runs: list[ReportRun]) -> tuple[Card, dict]:
    import pandas as pd

    card = Card(8, "Unequal devices: uniform micro-batches vs batches sized per rank")
    ok = [r for r in runs if r.status == "ok"]
    pairs = {}
    for run in ok:
        if run.as_built.world_size > 1:
            pairs.setdefault(device_key(run), []).append(run)
    singles = {r.throughput.samples_per_step: r for r in ok if r.as_built.world_size == 1}
    evidence = {"how": "distlab/report/cards/unequal.py", "pairs": []}
    rows, verdicts = [], []
    fig, ax = figure()
    for group in pairs.values():
        uniform = next((r for r in group if r.spec.rank_micro_batch is None), None)
        if uniform is None:
            continue
        base = uniform.throughput.tokens_per_s
        labels, values = [], []
        for run in sorted(group, key=lambda r: r.spec.rank_micro_batch is not None):
            tps = run.throughput.tokens_per_s
            one = singles.get(run.throughput.samples_per_step)
            parity = "-" if one is None else \
                f"{max(abs(a - b) for a, b in zip(run.loss.per_step, one.loss.per_step)):.1e}"
            rows.append({"experiment": run.experiment, "devices": devices(run),
                         "micro-batch per rank": " / ".join(map(str, sizes(run))),
                         "tokens/s": round(tps, 1), "vs uniform": f"{tps / base:.2f}x",
                         "median step ms": round(run.timing.step_time_s.median * 1e3, 1),
                         "waiting for a slower rank, ms/step per rank": idle_ms(run),
                         "max loss diff vs 1 rank": parity})
            labels.append("uniform" if run is uniform else "sized " + "/".join(map(str, sizes(run))))
            values.append(tps)
            if run is not uniform:
                won = tps > base and clear_winner(run, uniform)
                verdicts.append((run, uniform, won))
                evidence["pairs"].append({"devices": devices(run), "uniform": sizes(uniform), "sized": sizes(run),
                                          "speedup": round(tps / base, 3), "clear": won})
        ax.plot(labels, values, marker="o", label=devices(uniform)[:60])
    how = ("tokens/s = global tokens per step / median step time (max over ranks) after warm-up, same global batch; "
           "waiting = each rank's all-reduce time in flight (median per step) minus the least of any rank: the fast "
           "rank's wait for the slow one; loss diff vs a 1-rank run of the same global batch (the same samples: "
           f"distlab.rank.loop.IndexStream). {SPREAD_CAVEAT}")
    if rows:
        label_axes(ax, "micro-batches", "tokens/s", "Uniform vs sized batches on unequal ranks")
        card.figures.append(Figure("Uniform vs sized", to_png_b64(fig), how))
        card.tables.append(Table("Uniform vs sized micro-batches", pd.DataFrame(rows), how))
    if verdicts:
        won = [v for v in verdicts if v[2]]
        card.goals.append(Goal("minimal", "Sized batches beat uniform batches on unequal ranks",
                               PASSED if len(won) == len(verdicts) else FAILED,
                               "; ".join(f"{r.experiment}: "
                                         f"{r.throughput.tokens_per_s / u.throughput.tokens_per_s:.2f}x "
                                         f"uniform ({'clear' if w else 'not clear: spreads overlap or slower'})"
                                         for r, u, w in verdicts),
                               [metrics_link(r) for r, _, _ in verdicts]))
    else:
        card.goals.append(Goal("minimal", "Sized batches beat uniform batches on unequal ranks",
                               NOT_RUN, "needs a uniform and a sized run on the same unequal ranks (stage `unequal`)"))
    card.notes.append("Sized batches keep the global batch and the gradient (each rank's loss weighted by its share of "
                      "the batch's label tokens; tests/test_unequal.py checks the gradient against 1 rank to 1e-6). On "
                      "CPU a slower device is a rank with less CPU time (rank_cpu_budget: a CFS quota of its own "
                      "cgroup) or fewer threads (rank_cpu_threads); on GPUs, cards of different speed and memory.")
    return card, evidence

