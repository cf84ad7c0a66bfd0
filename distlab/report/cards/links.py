"""The link card (`snakemake links`): the same DDP, ZeRO-2/3, FSDP and TP runs over links of
several speeds, each rank on a host of its own (distlab/launchers/links.py). Not a `stage*` module: the
milestone report does not show it; its own page does, and the advisor cites its card.json."""
from __future__ import annotations

from distlab.records.spec import Spec
from distlab.configuration.config_links import link_label
from distlab.report.cards import FAILED, NOT_RUN, PASSED, SPREAD_CAVEAT, Card, Figure, Goal, Table, comm_ms, \
    metrics_link
from distlab.report.plots import figure, label_axes, to_png_b64
from distlab.report.report_run import ReportRun

# The roadmap's interconnects, Gbit/s each way (PCIe 4.0 x16 ~32 GB/s, NVLink ~900 GB/s).
INTERCONNECTS = {"1 Gbit Ethernet": 1, "10 Gbit Ethernet": 10, "PCIe 4.0 x16": 256, "NVLink (H100)": 7200}


def strategy_label(spec: Spec) -> str:
    if spec.strategy == "deepspeed":
        return f"ZeRO-{spec.deepspeed.zero_stage}"
    return {"ddp": "DDP", "fsdp": "FSDP", "tp": "TP", "pp": "PP"}.get(spec.strategy, spec.strategy)


def cap_of(run: ReportRun) -> float | None:
    return run.spec.link.bandwidth_mbit


def cap_order(cap: float | None) -> float:
    return float("inf") if cap is None else cap


def wire_bytes_per_step(run: ReportRun) -> float | None:
    """Bytes each host sent per optimizer step during the steps (its eth0 counters around
    train(), mean over hosts), warm-up steps included."""
    traffic = run.as_built.get("link_traffic")
    if not traffic:
        return None
    return sum(t["tx_bytes"] for t in traffic) / len(traffic) / run.spec.steps


def step_s(run: ReportRun) -> float:
    return run.timing.step_time_s.median


def transfer_free_step(at: dict) -> tuple[float | None, float | None]:
    """(T0, bytes per step) of a strategy: its step without the link's transfer time, the median
    over its capped runs of step - bits / cap (the transfer's lower bound at that cap)."""
    capped = [(run, wire_bytes_per_step(run)) for cap, run in at.items() if cap and wire_bytes_per_step(run)]
    if not capped:
        return None, None
    rest = sorted(step_s(run) - wire * 8 / (run.spec.link.bandwidth_mbit * 1e6) for run, wire in capped)
    return rest[len(rest) // 2], sorted(w for _, w in capped)[len(capped) // 2]


def break_even(one: ReportRun, at: dict) -> tuple[float | None, str]:
    """Mbit/s above which 2 ranks beat 1 in the model step(bw) = T0 + bits/bw (no overlap):
    bw* = bits / (T_1 - T0)."""
    t0, wire = transfer_free_step(at)
    if t0 is None:
        return None, "needs capped runs with their link traffic"
    gain = step_s(one) - t0
    if gain <= 0:
        return None, (f"never here: even with no transfer time its step ({t0 * 1e3:.0f} ms) is no shorter than 1 "
                      f"rank's ({step_s(one) * 1e3:.0f} ms)")
    return wire * 8 / gain / 1e6, ""


def where_it_stops(points: list[tuple[float | None, float]]) -> str:
    """From (cap, speedup) measured points, sorted by cap: where 2 ranks beat 1 and where not."""
    paying = [cap for cap, speedup in points if speedup >= 1]
    losing = [cap for cap, speedup in points if speedup < 1]
    if not losing:
        return f"pays at every measured link (down to {link_label(points[0][0])})"
    if not paying:
        return f"slower than 1 rank at every measured link (up to {link_label(points[-1][0])})"
    below, above = max(losing, key=cap_order), min(paying, key=cap_order)
    if cap_order(below) < cap_order(above):
        return f"stops paying between {link_label(above)} (faster than 1 rank) and {link_label(below)} (slower)"
    return ("not monotonic (shared machine's noise): faster than 1 rank at " + ", ".join(map(link_label, paying))
            + "; slower at " + ", ".join(map(link_label, losing)))


def collectives_rows(collectives: dict) -> tuple[list[dict], list[dict]]:
    rows, series = [], []
    for label, result in collectives.items():
        cap = result["link"]["bandwidth_mbit"]
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            ok = [r for r in result["results"] if r["op"] == op and r["status"] == "ok"]
            if not ok:
                continue
            big = max(ok, key=lambda r: r["size_bytes"])
            rows.append({"link": label, "op": op, "bytes": big["size_bytes"],
                         "time ms": round(big["time_s_median"] * 1e3, 2),
                         "busbw Gbit/s": round(big["busbw_bytes_per_s"] * 8 / 1e9, 3),
                         "busbw / cap": round(big["busbw_bytes_per_s"] * 8 / 1e6 / cap, 2) if cap else "-"})
            if op == "all_reduce":
                series.append((label, [r["size_bytes"] for r in ok], [r["busbw_bytes_per_s"] * 8 / 1e9 for r in ok]))
    return rows, series


def prediction_table(card: Card, linked: list[dict]) -> None:
    """Each link run's step time predicted before it ran (its link's collectives file) against the
    measured median, and the bytes the model says each host sends against the host's counters."""
    import pandas as pd

    from distlab.records.predictions import LINK_TOLERANCE, check_step_times, step_time_verdict

    rows = check_step_times([run.metrics for run in linked], LINK_TOLERANCE)
    if not rows:
        return
    by_name = {r.experiment: r for r in linked}
    for row in rows:
        run = by_name[row["experiment"]]
        predicted = ((run.section("prediction") or {}).get("terms") or {}) \
            .get("communication", {}).get("wire_bytes_per_rank")
        wire = wire_bytes_per_step(run)
        row["link"] = link_label(cap_of(run))
        row["predicted MB/step sent"] = None if predicted is None else round(predicted / 1e6, 3)
        row["measured MB/step sent"] = None if wire is None else round(wire / 1e6, 3)
    status, evidence = step_time_verdict(rows, share=1.0)
    card.goals.append(Goal("minimal", f"Step time predicted within {LINK_TOLERANCE:.0%} at every link",
                           {"passed": PASSED, "failed": FAILED}.get(status, NOT_RUN), evidence))
    card.tables.append(Table("Predicted before the run vs measured, at each link", pd.DataFrame(rows), (
        "predicted: distlab.tools.step_time from the compute probe and the link's own collectives file "
        "(links/collectives-<cap>.json), made by rank 0 before the first step; measured: the median step. "
        "MB/step sent: the bytes the model says each host sends per step (ring algorithms: an all-reduce of B "
        "bytes sends B per host at 2 hosts, an all-gather or reduce-scatter B/2) against the host's eth0 "
        "counters (every step, warm-up and the loss's reduction included).")))


def build(runs: list[ReportRun], collectives: dict) -> tuple[Card, dict]:
    import pandas as pd

    card = Card(7, "Links: the same strategies over a 100 Mbit/s home network, 1 and 10 Gbit/s, and no cap")
    linked = [r for r in runs if r.status == "ok" and r.spec.link]
    singles = [r for r in runs if r.status == "ok" and r.as_built.world_size == 1]
    evidence = {"how": "distlab/report/cards/links.py", "strategies": {}}
    if not linked or not singles:
        card.goals.append(Goal("minimal", "Strategies measured over capped links against 1 rank", NOT_RUN if not runs
                               else FAILED, "needs a 1-rank run and 2-rank runs with a link (stage `links`)"))
        return card, evidence
    one = singles[0]
    gbs = one.throughput.samples_per_step
    by_strategy: dict[str, dict] = {}
    for run in linked:
        by_strategy.setdefault(strategy_label(run.spec), {})[cap_of(run)] = run
    rows, stops, fig, ax = [], [], *figure(6.4, 3.6)
    caps = sorted({cap_of(r) for r in linked}, key=cap_order)
    for name, at in by_strategy.items():
        points = []
        for cap in sorted(at, key=cap_order):
            run = at[cap]
            speedup = run.throughput.tokens_per_s / one.throughput.tokens_per_s
            points.append((cap, speedup))
            wire = wire_bytes_per_step(run)
            rows.append({"strategy": name, "link": link_label(cap), "experiment": run.experiment,
                         "tokens/s": round(run.throughput.tokens_per_s, 1),
                         "speedup vs 1 rank": round(speedup, 2), "median step ms": round(step_s(run) * 1e3, 1),
                         "comm in flight ms/step": comm_ms(run),
                         "MB/step each host sent": None if wire is None else round(wire / 1e6, 2),
                         "link busy": "-" if cap is None or wire is None else
                         f"{wire * 8 / step_s(run) / 1e6 / cap:.0%}"})
        ax.plot([caps.index(c) for c, _ in points], [s for _, s in points], marker="o", label=name)
        star, why = break_even(one, at)
        stop = where_it_stops(points)
        evidence["strategies"][name] = {"speedup_by_link": {link_label(c): round(s, 3) for c, s in points},
                                        "stops_paying": stop, "break_even_mbit": star}
        needed = "" if star is None else "; ".join(f"x{k}: {star * k / 1e3:,.1f} Gbit/s" for k in (100, 1000))
        stops.append({"strategy": name, "measured": stop,
                      "break-even link (this CPU)": why or f"{star:,.0f} Mbit/s",
                      "same balance, device 100x / 1000x faster": needed or "-",
                      "fits": "-" if star is None else ", ".join(
                          f"{k}" for k, gbit in INTERCONNECTS.items() if gbit * 1e3 >= star * 1000) or "none listed"})
    ax.axhline(1, color="grey", linestyle="--", label="1 rank")
    ax.set_xticks(range(len(caps)), [link_label(c) for c in caps])
    how = (f"2 ranks, one per host (network namespace), link capped with tc tbf each way; tokens/s at the same "
           f"global batch ({gbs}) as the 1-rank run {one.experiment} (loopback, no link); median step after "
           f"warm-up; MB/step = bytes each host's eth0 sent during the steps / steps (kernel counters); link busy = "
           f"those bits per median step / cap. {SPREAD_CAVEAT}")
    label_axes(ax, "link (each way)", "tokens/s / 1-rank tokens/s", "Speedup over 1 rank by link speed")
    card.figures.append(Figure("Speedup over 1 rank by link", to_png_b64(fig), how))
    card.tables.append(Table("Each strategy at each link", pd.DataFrame(rows), how))
    card.tables.append(Table("Where each strategy stops paying", pd.DataFrame(stops), (
        "measured: at which links 2 ranks beat 1; break-even: bw* = bits each host sends per step / (1-rank step - "
        "T0), T0 = the strategy's step without transfer time (median over its capped runs of step - bits / cap); no "
        "compute/communication overlap assumed (DDP overlaps, so its real break-even is lower). A device whose step is "
        "k times shorter needs k times the bandwidth for the same "
        "balance; 'fits' lists the roadmap's interconnects (Gbit/s each way: " + ", ".join(
            f"{k} {v:,}" for k, v in INTERCONNECTS.items()) + ") that carry it at x1000.")))
    prediction_table(card, linked)
    card.goals.append(Goal("minimal", "Strategies measured over capped links against 1 rank", PASSED,
                           f"{len(linked)} runs: {', '.join(sorted(by_strategy))} at "
                           f"{', '.join(link_label(c) for c in caps)}",
                           [metrics_link(r) for r in linked[:1]] + [metrics_link(one)]))
    ddp = by_strategy.get("DDP", {})
    capped = sorted((c for c in ddp if c is not None))
    if len(capped) >= 2 and all(ddp[c].timing.comm_inflight_s_per_step.median for c in capped):
        comm = [ddp[c].timing.comm_inflight_s_per_step.median for c in capped]
        ordered = all(a > b for a, b in zip(comm, comm[1:]))
        card.goals.append(Goal("bonus", "A slower link slows DDP's all-reduce, in order", PASSED if ordered else FAILED,
                               ", ".join(f"{link_label(c)}: {t * 1e3:.1f} ms" for c, t in zip(capped, comm))
                               + " all-reduce in flight per step", [metrics_link(ddp[c]) for c in capped]))
    rows, series = collectives_rows(collectives)
    if rows:
        fig, ax = figure()
        for label, sizes, busbw in series:
            ax.plot(sizes, busbw, marker=".", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        how = ("distlab.tools.collectives with each rank on its own host of the link (gloo, float32, median of timed "
               "calls, the slowest rank's time); nccl-tests' busbw; the largest message of each op")
        label_axes(ax, "message bytes", "all-reduce busbw (Gbit/s)", "Collective bandwidth by link")
        card.figures.append(Figure("All-reduce bus bandwidth by link", to_png_b64(fig), how))
        card.tables.append(Table("Collectives over each link", pd.DataFrame(rows), how))
        evidence["busbw_gbit"] = {r["link"]: r["busbw Gbit/s"] for r in rows if r["op"] == "all_reduce"}
    card.notes.append(
        "The roadmap: without NVLink avoid tensor and pipeline parallel (their per-layer transfers cross the slow "
        "link) and use data parallel or ZeRO; batches too small for the link make communication outweigh the compute "
        "gain. Here the 'link' is a capped veth between namespaces of one CPU machine: the caps and bytes are real, "
        "the compute is a CPU's, so the break-even bandwidths are this machine's; the x100 / x1000 columns show where "
        "the same strategy lands for a device that much faster.")
    return card, evidence

