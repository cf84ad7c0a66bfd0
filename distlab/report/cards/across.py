"""The cards that span stages: strategy ranking across all runs, machines side by side,
collective bandwidth with the data-parallel break-even batch, loss curves per stage. Not `stage*`
modules: the report (distlab.report.build) places them after the stage cards."""
from __future__ import annotations

from distlab.records import collectives as coll
from distlab.records.run_outputs import DEFAULT_TASK
from distlab.report.cards import Card, Figure, Table, plain_speed, run_task, spread_caveat
from distlab.report.collect import clear_winner
from distlab.report.plots import bandwidth_curves, loss_panels, ranking
from distlab.report.report_run import ReportRun

NO_CLEAR_WINNER = "no clear winner"


def card_noting_missing(number: int, title: str, source: dict, missing: str) -> Card:
    """A card whose input file may be absent: then it says which file and which rule."""
    card = Card(number, title)
    if not source:
        card.notes.append(missing)
    return card


def ranking_card(runs: list[ReportRun]) -> Card:
    import pandas as pd

    card = Card(91, "Strategy ranking across all runs")
    # Tokens/s only: a text-to-image run's images/s is ranked on its own card.
    ok = [r for r in runs if r.throughput_spread and r.spec.sampler == "distributed" and r.unit == "token"]
    if not ok:
        card.notes.append("No successful run yet.")
        return card
    skipped = [r.experiment for r in runs if r.throughput_spread and r.spec.sampler != "distributed"]
    if skipped:
        card.notes.append(f"Left out: {', '.join(sorted(set(skipped)))} (no DistributedSampler: its ranks read the "
                          "same samples, so its tokens/s counts duplicates).")
    for machine in sorted({r.machine for r in ok}):
        mine = sorted((r for r in ok if r.machine == machine), key=lambda r: -r.throughput_spread.median)
        rows = []
        for i, run in enumerate(mine):
            t, nxt = run.throughput_spread, mine[i + 1] if i + 1 < len(mine) else None
            versus = "" if nxt is None else ("faster" if clear_winner(run, nxt) else NO_CLEAR_WINNER)
            rows.append({"rank": i + 1, "experiment": run.experiment, "stage": run.stage,
                         "tokens/s": round(t.median, 1), "spread": f"{t.low:.1f}-{t.high:.1f}",
                         "timed steps": t.timed_steps,
                         "vs next": versus, "ranks": run.as_built.world_size,
                         "wrapped by": run.as_built.get("outer_wrapper"),
                         "checkpoint check": run.validation and
                         ("passed" if run.validation.get("passed") else "failed") or "-"})
        hows = sorted({r.throughput_spread.how for r in mine})
        # One sentence when every run was timed alike; else the per-run count is the column.
        timing = hows[0] if len(hows) == 1 else ("median tokens/s over each run's timed steps (column 'timed "
                                                 "steps'), spread from the step-time interquartile range, or "
                                                 "the min-max of its windows where spec 'repeats' asks")
        how = (f"{timing}; tokens = every rank's tokens per optimizer step; device "
               f"{mine[0].spec.device}; torch {mine[0].section('versions').get('torch')}. Runs of different "
               "global batch or method are not like-for-like: read the ranking with the stage cards. The "
               f"{spread_caveat(mine)}.")
        card.tables.append(Table(f"{machine}: fastest first", pd.DataFrame(rows), how))
        card.figures.append(Figure(f"{machine}: tokens/s by run", ranking(
            [{"label": r.experiment, "median": r.throughput_spread.median, "low": r.throughput_spread.low,
              "high": r.throughput_spread.high} for r in mine], f"{machine}: tokens/s"), how))
    return card


def machines_card(runs: list[ReportRun], hardware: dict) -> Card | None:
    import pandas as pd

    machines = sorted({r.machine for r in runs})
    if len(machines) < 2:
        return None
    card = Card(92, "Machines side by side")
    rows = {}
    for run in (r for r in runs if r.unit == "token"):  # tokens/s cells; images/s are on their card
        t = run.throughput_spread
        cell = f"{t.median:.1f} ({t.low:.1f}-{t.high:.1f})" if t else run.status
        rows.setdefault(run.experiment, {"experiment": run.experiment})[run.machine] = cell
    for experiment, row in rows.items():
        pair = [r for r in runs if r.experiment == experiment and r.throughput_spread]
        if len(pair) >= 2:
            best = max(pair, key=lambda r: r.throughput_spread.median)
            others = [r for r in pair if r is not best]
            row["faster"] = best.machine if all(clear_winner(best, o) for o in others) else NO_CLEAR_WINNER
    card.tables.append(Table("tokens/s per experiment and machine (median, spread)",
                             pd.DataFrame(list(rows.values())),
                             f"each cell measured on that machine; 'no clear winner' when the spreads overlap; "
                             f"{spread_caveat(runs)}"))
    hw = [{"machine": m, "cpu": h.get("cpu", {}).get("model"), "cores": h.get("cpu", {}).get("usable_cores"),
           "gpus": ", ".join(g["name"] for g in h.get("gpus", [])) or "none"} for m, h in sorted(hardware.items())]
    if hw:
        card.tables.append(Table("Hardware", pd.DataFrame(hw), "from each machine's hardware.json"))
    return card


def collectives_card(bench: dict, runs: list[ReportRun]) -> Card:
    import pandas as pd

    card = card_noting_missing(93, "Communication: collective bandwidth and when N ranks beat 1", bench,
                               "No collectives.json (rule `collectives`); the benchmark has not run.")
    if not bench:
        return card
    series, rows = [], []
    for machine, result in sorted(bench.items()):
        n = result["world_size"]
        for backend in sorted({r["backend"] for r in result["results"]}):
            for op in coll.OPS:
                ok = [r for r in result["results"] if r["backend"] == backend and r["op"] == op and r["status"] == "ok"]
                bad = [r for r in result["results"] if r["backend"] == backend and r["op"] == op
                       and r["status"] != "ok"]
                if bad:
                    card.notes.append(f"{machine} {backend} {op}: {bad[0]['status']} ({bad[0].get('reason')})")
                if not ok:
                    continue
                series.append({"label": f"{machine} {backend} {op}", "sizes": [r["size_bytes"] for r in ok],
                               "busbw": [r["busbw_bytes_per_s"] for r in ok]})
                for r in ok:
                    rows.append({"machine": machine, "backend": backend, "op": op, "ranks": n, "bytes": r["size_bytes"],
                                 "time us": round(r["time_s_median"] * 1e6, 1),
                                 "algbw GB/s": round(r["algbw_bytes_per_s"] / 1e9, 3),
                                 "busbw GB/s": round(r["busbw_bytes_per_s"] / 1e9, 3)})
        card.notes.extend(break_even_notes(machine, result, runs))
    how = next(iter(bench.values()))["how"] + ". " + " ".join(
        f"{m}: {r['world_size']} ranks, {r['device']}, {r.get('threads_per_rank')} thread(s)/rank, torch "
        f"{r['versions'].get('torch')}." for m, r in sorted(bench.items()))
    card.figures.append(Figure("Bus bandwidth vs message size",
                               bandwidth_curves(series, "bus bandwidth (nccl-tests busbw)"), how))
    card.tables.append(Table("Measured collectives", pd.DataFrame(rows), how))
    return card


def break_even_notes(machine: str, result: dict, runs: list[ReportRun]) -> list[str]:
    """The global batch above which N data-parallel ranks beat one, from measured numbers."""
    n = result["world_size"]
    singles = [r for r in runs if r.machine == machine and r.status == "ok" and r.stage == "ddp"
               and r.as_built.world_size == 1 and r.unit == "token" and plain_speed(r)]
    if not singles:
        return [f"{machine}: no 1-rank DDP run, so no break-even batch (needs its compute time per sample)."]
    one = singles[0]
    backend = "nccl" if result["device"] == "cuda" else "gloo"
    grad_bytes = one.section("parameters").trainable * 4  # fp32 gradients (autocast keeps fp32 weights)
    allreduce = coll.time_at(result, "all_reduce", backend, grad_bytes)
    if allreduce is None:
        return [f"{machine}: no {backend} all-reduce measurement, so no break-even batch."]
    per_sample = one.timing.step_time_s.median / one.throughput.samples_per_step
    b_star = coll.break_even_global_batch(per_sample, allreduce, n)
    text = (f"{machine}: one sample costs {per_sample * 1e3:.1f} ms of compute ({one.experiment}, median step / "
            f"samples per step); all-reducing the {grad_bytes / 2**20:.1f} MiB of gradients over {n} ranks costs "
            f"{allreduce * 1e3:.1f} ms ({backend}, interpolated from the benchmark). With no overlap, {n} ranks "
            f"beat 1 once the global batch exceeds B* = a*N/(c*(N-1)) = {b_star:.1f} samples (upper bound: DDP "
            "overlaps the all-reduce with backward).")
    peers = [r for r in runs if r.machine == machine and r.status == "ok" and r.stage == "ddp"
             and r.unit == "token" and r.as_built.world_size == n and r.spec.sampler == "distributed"
             and r.throughput.samples_per_step == one.throughput.samples_per_step and plain_speed(r)]
    if peers:
        speed = peers[0].throughput.tokens_per_s / one.throughput.tokens_per_s
        batch = one.throughput.samples_per_step
        text += (f" Measured at global batch {batch}: {n} ranks ran {speed:.2f}x the 1-rank tokens/s "
                 f"({peers[0].experiment}); the estimate predicted "
                 f"{'a speedup' if batch > b_star else 'no speedup'}.")
    return [text]


def loss_card(runs: list[ReportRun]) -> Card:
    card = Card(94, "Loss curves per stage")
    by_stage = {}
    for run in runs:
        if run.status == "ok":  # a text-to-image run's loss (a denoising MSE) gets a panel of its own
            task = run_task(run)
            by_stage.setdefault(run.stage if task == DEFAULT_TASK else f"{run.stage} ({task})", []).append(run)
    if by_stage:
        card.figures.append(Figure("Loss per optimizer step, one panel per stage", loss_panels(by_stage),
                                   "mean training loss over data-parallel ranks per optimizer step, warm-up included"))
    return card
