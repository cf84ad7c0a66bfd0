"""The milestone report: where you stand (overview), what to run next (advisor), one card per
roadmap stage, then what spans stages: strategy ranking, machines side by side, collective
bandwidth with the data-parallel break-even batch, loss curves. Self-contained HTML (plots
embedded, readable on a phone, printable) and Markdown (distlab.report.render).
"""
from __future__ import annotations

import os

from distlab import advisor as adv
from distlab import advisor_check
from distlab import collectives as coll
from distlab.report.cards import (COMPARED, DOUBTFUL, FAILED, NOT_RUN, PASSED, Card, Figure, Table, all_cards,
                                  is_busy, spread_caveat)
from distlab.report.cards.checkpoint_table import checkpoint_card
from distlab.report.collect import (COLLECTIVES_SCHEMA_VERSION, HARDWARE_SCHEMA_VERSION, ResultsError,
                                    attach_machine_records, clear_winner, load_checked_runs, load_runs,
                                    machine_files, read_json, summary_frame, unit_of)
from distlab.report.plots import bandwidth_curves, loss_panels, ranking
from distlab.report.render import render_html, render_markdown

NO_CLEAR_WINNER = "no clear winner"


def overview_card(cards: list[Card], runs: list[dict], advice: dict) -> Card:
    import pandas as pd

    rows = []
    for card in cards:
        row = {"stage": card.title}
        for kind in ("minimal", "bonus"):
            goals = [g for g in card.goals if g.kind == kind]
            passed = sum(g.status == PASSED for g in goals)
            # Several goals of one kind, some not run: say how many passed, not "not run".
            row[kind] = (FAILED if any(g.status == FAILED for g in goals) else
                         DOUBTFUL if any(g.status == DOUBTFUL for g in goals) else
                         PASSED if goals and passed == len(goals) else
                         f"{passed} of {len(goals)} passed" if passed else
                         COMPARED if any(g.status == COMPARED for g in goals) else NOT_RUN)
        rows.append(row)
    frame = pd.DataFrame(rows, columns=["stage", "minimal", "bonus"])
    card = Card(0, "What to run here, and where you stand")
    card.notes.extend(headline(runs, advice))
    card.notes.append(busy_note(runs))
    if len(frame):
        done = int((frame[["minimal", "bonus"]] == PASSED).sum().sum())
        card.notes.append(f"{done} of {2 * len(frame)} stage goals passed from {len(runs)} measured run(s) "
                          f"({sum(r.get('status') == 'ok' for r in runs)} ok, "
                          f"{sum(r.get('status') == 'oom' for r in runs)} out of memory).")
    card.tables.append(Table("Roadmap goals", frame, f"{PASSED} / {FAILED} / {NOT_RUN} / {COMPARED} (a limit the "
                                                     f"runs were compared with, not held to) / {DOUBTFUL} (a figure "
                                                     "the setup cannot produce, shown with its likely cause), "
                                                     "computed from the runs below"))
    return card


def headline(runs: list[dict], advice: dict) -> list[str]:
    """What to run on each machine (the advisor's pick and why) and the measured evidence: the
    tokens/s of every strategy on the most common same-work comparison of that machine."""
    lines = []
    for machine in sorted(set(advice) | {r["machine"] for r in runs}):
        a = advice.get(machine)
        text = (f"Run {a['recommendation_label']} on {machine}: {a['reasons'][0]}." if a else
                f"{machine}: no advice (rule `advise` did not run for it).")
        timed = [r for r in runs if r["machine"] == machine and r.get("_throughput")
                 and r["spec"]["sampler"] == "distributed" and r["spec"].get("model", "default") == "default"]
        groups = {}
        for run in timed:
            s = run["spec"]
            groups.setdefault((run["throughput"]["samples_per_step"], s["seq_len"], s["method"], s["precision"]),
                              []).append(run)
        if groups:
            (batch, seq, method, precision), same = max(groups.items(), key=lambda kv: len(kv[1]))
            same.sort(key=lambda r: -r["_throughput"]["median"])
            text += (f" Measured here on the same work ({method} fine-tuning, global batch {batch} x {seq} tokens, "
                     f"{precision}), tokens/s: " + ", ".join(
                         f"{r['experiment']} {r['_throughput']['median']:.0f}" + (" (BUSY)" if is_busy(r) else "")
                         for r in same[:6]) + (f" and {len(same) - 6} more" if len(same) > 6 else "") + ".")
            picked = [r for r in same if a and advisor_check.estimate_key(r["spec"]) == a["recommendation"]]
            if picked and same[0] is not picked[0]:
                text += (f" The fastest here, {same[0]['experiment']}, ran {same[0]['_throughput']['median'] / picked[0]['_throughput']['median']:.2f}x "
                         f"the best run of the recommended kind ({picked[0]['experiment']}): the "
                         "advice picks by memory fit and the roadmap's rules, not by this machine's speed"
                         + ("; the spreads overlap, so this machine does not tell them apart."
                            if not clear_winner(same[0], picked[0]) else "."))
        if a:
            checked = advisor_check.check_against_runs(a, [r for r in runs if r["machine"] == machine])
            if checked:
                right = sum(c["verdict"] == "right" for c in checked)
                text += (f" The advisor's memory estimate was right (within {adv.TOLERANCE:.0%}) for {right} of "
                         f"{len(checked)} run(s) measured here.")
        lines.append(text)
    return lines


def busy_note(runs: list[dict]) -> str:
    """How many runs were timed on a busy machine (distlab.noise), named: their speed figures
    include waiting for a core and say nothing about the strategy."""
    timed = [r for r in runs if r.get("status") == "ok"]
    recorded = [r for r in timed if (r.get("noise") or {}).get("busy") is not None]
    busy = [r for r in recorded if is_busy(r)]
    if not recorded:
        return "Machine load during the timed steps was not recorded for these runs: speed figures are unqualified."
    if not busy:
        return (f"All {len(recorded)} timed run(s) ran on a quiet machine (no other process needed the cores they "
                "left free): their speed figures are the strategies' own.")
    return (f"BUSY MACHINE: {len(busy)} of {len(recorded)} run(s) were timed while other processes needed the cores "
            f"they had left free ({', '.join(r['experiment'] for r in busy)}): their step times include waiting for "
            "a core, so their speed figures (marked BUSY in the tables) are inflated by an unknown amount; rerun them "
            "on a quiet machine before comparing speeds.")


def card_noting_missing(number: int, title: str, source: dict, missing: str) -> Card:
    """A card whose input file may be absent: then it says which file and which rule."""
    card = Card(number, title)
    if not source:
        card.notes.append(missing)
    return card


def advisor_card(advice: dict, runs: list[dict], left_out: list[dict] | None = None) -> Card:
    card = card_noting_missing(90, "Advisor: what to run on this hardware", advice,
                               "No advice.json found (rule `advise`); run `snakemake advise`.")
    for machine, a in sorted(advice.items()):
        try:
            # The advice sizes the causal LM: runs counted in tokens (a text-to-image run has its own advisor).
            advise_machine(card, machine, a, [r for r in runs if r["machine"] == machine and unit_of(r) == "token"])
        except ValueError as error:  # transformers refuses the model its config_json describes
            if left_out is not None:
                left_out.append({"path": f"{machine}/advice.json", "reason": f"{machine}/advice.json: {error}"})
    return card


def advise_machine(card: Card, machine: str, a: dict, runs: list[dict]) -> None:
    """One machine's advice: the recommendation, the estimate table, the check against its runs."""
    import pandas as pd

    card.notes.append(f"{machine}: recommended {a['recommendation_label']}. " + " ".join(
        f"{r[0].upper()}{r[1:]}." for r in a["reasons"]))
    unit, scale = adv.unit_for(max(r["total_bytes"] for r in a["estimates"]))
    frame = pd.DataFrame([{"strategy": r["strategy"], f"params {unit}": round(r["params"] / scale, 2),
                           f"grads {unit}": round(r["grads"] / scale, 2),
                           f"optimizer {unit}": round(r["optimizer"] / scale, 2),
                           f"gathered {unit}": round(r["gathered"] / scale, 2),
                           f"activations {unit}": round(r["activation_bytes"] / scale, 2),
                           # absent from advice written before the data was counted (its total lacks it too)
                           f"data {unit}": round(r.get("data_bytes", 0) / scale, 2),
                           f"total {unit}/device": round(r["total_bytes"] / scale, 2),
                           f"in CPU RAM {unit}": round(r["cpu_offloaded"] / scale, 2),
                           "fits": "yes" if r["total_bytes"] <= a["usable_bytes_per_device"] else "no"}
                          for r in a["estimates"]])
    plan = a["devices"]
    card.tables.append(Table(f"Estimated memory per device on {machine} ({plan['devices']} device(s), "
                             f"{adv.human(a['usable_bytes_per_device'])} usable each)", frame,
                             " ".join(a["how"].split())))
    checked = advisor_check.check_against_runs(a, runs)
    if checked:
        wrong = [c for c in checked if c["verdict"] != "right"]
        key = ["experiment", "verdict", "measured/estimated", "where"]
        frame = pd.DataFrame(checked)
        frame = frame[key + [c for c in frame.columns if c not in key]]
        card.tables.append(Table(f"Estimate vs measured on {machine}", frame,
                                 "model state = params + grads (DDP's buckets included) + optimizer bytes "
                                 "the rank held at the last step, offloaded ones too, counted from its "
                                 f"tensors; right = the total and each of params, grads and optimizer within "
                                 f"{adv.TOLERANCE:.0%} ('where' names a part that is not). Activations: the bytes "
                                 "autograd held at the end of one micro-batch's forward on rank 0 (saved-tensor "
                                 "hooks) vs distlab.activations' estimate (data-parallel strategies; peak RSS, "
                                 "which includes the interpreter and libraries, is not compared)."))
        card.notes.append(f"The estimate was wrong for {len(wrong)} of {len(checked)} run(s)"
                          + (": " + "; ".join(f"{c['experiment']} ({c['where'] or 'total'})" for c in wrong)
                             if wrong else "."))
    other = sorted(r["experiment"] for r in runs if r.get("status") == "ok"
                   and r["spec"].get("model", "default") != "default")
    if other:
        card.notes.append(f"Not checked against the estimate: {', '.join(other)} (another model than the "
                          "base model the advice sizes: model.extra).")


def ranking_card(runs: list[dict]) -> Card:
    import pandas as pd

    card = Card(91, "Strategy ranking across all runs")
    # Tokens/s only: a text-to-image run's images/s is ranked on its own card.
    ok = [r for r in runs if r.get("_throughput") and r["spec"]["sampler"] == "distributed" and unit_of(r) == "token"]
    if not ok:
        card.notes.append("No successful run yet.")
        return card
    skipped = [r["experiment"] for r in runs if r.get("_throughput") and r["spec"]["sampler"] != "distributed"]
    if skipped:
        card.notes.append(f"Left out: {', '.join(sorted(set(skipped)))} (no DistributedSampler: its ranks read the "
                          "same samples, so its tokens/s counts duplicates).")
    for machine in sorted({r["machine"] for r in ok}):
        mine = sorted((r for r in ok if r["machine"] == machine), key=lambda r: -r["_throughput"]["median"])
        rows = []
        for i, run in enumerate(mine):
            t, nxt = run["_throughput"], mine[i + 1] if i + 1 < len(mine) else None
            versus = "" if nxt is None else ("faster" if clear_winner(run, nxt) else NO_CLEAR_WINNER)
            rows.append({"rank": i + 1, "experiment": run["experiment"], "stage": run["stage"],
                         "tokens/s": round(t["median"], 1), "spread": f"{t['low']:.1f}-{t['high']:.1f}",
                         "timed steps": t.get("timed_steps"),
                         "vs next": versus, "ranks": run["as_built"]["world_size"],
                         "wrapped by": run["as_built"].get("outer_wrapper"),
                         "checkpoint check": run.get("_validation") and
                         ("passed" if run["_validation"].get("passed") else "failed") or "-"})
        hows = sorted({r["_throughput"]["how"] for r in mine})
        # One sentence when every run was timed alike; else the per-run count is the column.
        timing = hows[0] if len(hows) == 1 else ("median tokens/s over each run's timed steps (column 'timed "
                                                 "steps'), spread from the step-time interquartile range, or "
                                                 "the min-max of its windows where spec 'repeats' asks")
        how = (f"{timing}; tokens = every rank's tokens per optimizer step; device "
               f"{mine[0]['spec']['device']}; torch {mine[0]['versions'].get('torch')}. Runs of different "
               f"global batch or method are not like-for-like: read the ranking with the stage cards. The {spread_caveat(mine)}.")
        card.tables.append(Table(f"{machine}: fastest first", pd.DataFrame(rows), how))
        card.figures.append(Figure(f"{machine}: tokens/s by run", ranking(
            [{"label": r["experiment"], **r["_throughput"]} for r in mine], f"{machine}: tokens/s"), how))
    return card


def machines_card(runs: list[dict], hardware: dict) -> Card | None:
    import pandas as pd

    machines = sorted({r["machine"] for r in runs})
    if len(machines) < 2:
        return None
    card = Card(92, "Machines side by side")
    rows = {}
    for run in (r for r in runs if unit_of(r) == "token"):  # tokens/s cells; images/s are on their card
        t = run.get("_throughput")
        cell = f"{t['median']:.1f} ({t['low']:.1f}-{t['high']:.1f})" if t else run.get("status")
        rows.setdefault(run["experiment"], {"experiment": run["experiment"]})[run["machine"]] = cell
    for experiment, row in rows.items():
        pair = [r for r in runs if r["experiment"] == experiment and r.get("_throughput")]
        if len(pair) >= 2:
            best = max(pair, key=lambda r: r["_throughput"]["median"])
            others = [r for r in pair if r is not best]
            row["faster"] = best["machine"] if all(clear_winner(best, o) for o in others) else NO_CLEAR_WINNER
    card.tables.append(Table("tokens/s per experiment and machine (median, spread)",
                             pd.DataFrame(list(rows.values())),
                             f"each cell measured on that machine; 'no clear winner' when the spreads overlap; "
                             f"{spread_caveat(runs)}"))
    hw = [{"machine": m, "cpu": h.get("cpu", {}).get("model"), "cores": h.get("cpu", {}).get("usable_cores"),
           "gpus": ", ".join(g["name"] for g in h.get("gpus", [])) or "none"} for m, h in sorted(hardware.items())]
    if hw:
        card.tables.append(Table("Hardware", pd.DataFrame(hw), "from each machine's hardware.json"))
    return card


def collectives_card(bench: dict, runs: list[dict]) -> Card:
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


def break_even_notes(machine: str, result: dict, runs: list[dict]) -> list[str]:
    """The global batch above which N data-parallel ranks beat one, from measured numbers."""
    n = result["world_size"]
    singles = [r for r in runs if r["machine"] == machine and r.get("status") == "ok" and r["stage"] == "ddp"
               and r["as_built"]["world_size"] == 1 and unit_of(r) == "token"]
    if not singles:
        return [f"{machine}: no 1-rank DDP run, so no break-even batch (needs its compute time per sample)."]
    one = singles[0]
    backend = "nccl" if result["device"] == "cuda" else "gloo"
    grad_bytes = one["parameters"]["trainable"] * 4  # fp32 gradients (autocast keeps fp32 weights)
    allreduce = coll.time_at(result, "all_reduce", backend, grad_bytes)
    if allreduce is None:
        return [f"{machine}: no {backend} all-reduce measurement, so no break-even batch."]
    per_sample = one["timing"]["step_time_s"]["median"] / one["throughput"]["samples_per_step"]
    b_star = coll.break_even_global_batch(per_sample, allreduce, n)
    text = (f"{machine}: one sample costs {per_sample * 1e3:.1f} ms of compute ({one['experiment']}, median step / "
            f"samples per step); all-reducing the {grad_bytes / 2**20:.1f} MiB of gradients over {n} ranks costs "
            f"{allreduce * 1e3:.1f} ms ({backend}, interpolated from the benchmark). With no overlap, {n} ranks "
            f"beat 1 once the global batch exceeds B* = a*N/(c*(N-1)) = {b_star:.1f} samples (upper bound: DDP "
            "overlaps the all-reduce with backward).")
    peers = [r for r in runs if r["machine"] == machine and r.get("status") == "ok" and r["stage"] == "ddp"
             and unit_of(r) == "token" and r["as_built"]["world_size"] == n and r["spec"]["sampler"] == "distributed"
             and r["throughput"]["samples_per_step"] == one["throughput"]["samples_per_step"]]
    if peers:
        speed = peers[0]["throughput"]["tokens_per_s"] / one["throughput"]["tokens_per_s"]
        batch = one["throughput"]["samples_per_step"]
        text += (f" Measured at global batch {batch}: {n} ranks ran {speed:.2f}x the 1-rank tokens/s "
                 f"({peers[0]['experiment']}); the estimate predicted {'a speedup' if batch > b_star else 'no speedup'}.")
    return [text]


def loss_card(runs: list[dict]) -> Card:
    card = Card(94, "Loss curves per stage")
    by_stage = {}
    for run in runs:
        if run.get("status") == "ok":  # a text-to-image run's loss (a denoising MSE) gets a panel of its own
            task = run["spec"].get("task", "causal-lm")
            by_stage.setdefault(run["stage"] if task == "causal-lm" else f"{run['stage']} ({task})", []).append(run)
    if by_stage:
        card.figures.append(Figure("Loss per optimizer step, one panel per stage", loss_panels(by_stage),
                                   "mean training loss over data-parallel ranks per optimizer step, warm-up included"))
    return card


def _versions(runs: list[dict]) -> str:
    seen = {}
    for run in runs:
        v = run.get("versions") or {}
        seen.setdefault(run["machine"], ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "deepspeed",
                                                                           "accelerate", "ray") if v.get(k)))
    return " ".join(f"Versions on {m}: {v}." for m, v in sorted(seen.items()))


def left_out_card(left_out: list[dict]) -> Card | None:
    """Every file the report did not trust, named with the reason (collect's schema checks)."""
    if not left_out:
        return None
    card = Card(95, "Files left out of this report")
    card.notes += [item["reason"] for item in left_out]
    return card


def build_report(metrics_paths, html_path, md_path, advice_paths=(), left_out=None, declared=None) -> list[dict]:
    """Write both pages from these metrics.json files (write_report says what it returns)."""
    return write_report(load_runs(metrics_paths, declared), html_path, md_path, advice_paths, left_out, declared)


def write_report(runs: list[dict], html_path, md_path, advice_paths=(), left_out=None, declared=None) -> list[dict]:
    """Write both pages from runs already loaded (each metrics.json is read once, by
    collect.load_run); returns the files left out ({"path", "reason"}): `left_out` (the runs
    the summary refused) and the machine files that failed their schema here. declared: the
    rule's inputs (distlab.report.inputs), the only files read."""
    left_out = list(left_out or [])
    for run in runs:
        run["_dir"] = os.path.abspath(run["_dir"])
    frame = summary_frame(runs)
    hardware = machine_files(runs, "hardware.json", HARDWARE_SCHEMA_VERSION, left_out, declared)
    bench = machine_files(runs, "collectives.json", COLLECTIVES_SCHEMA_VERSION, left_out, declared)
    # other machines' advice comes with their folders
    advice = machine_files(runs, "advice.json", 1, left_out, declared)
    attach_machine_records(runs, left_out, declared)
    for path in advice_paths:
        try:
            a = read_json(path, "advice", 1, "advice")
        except ResultsError as error:
            left_out.append({"path": str(path), "reason": str(error)})
            continue
        advice[os.path.basename(os.path.dirname(os.path.abspath(path)))] = a
    stage_cards = all_cards(runs)
    advisor = advisor_card(advice, runs, left_out)
    sections = [overview_card(stage_cards, runs, advice), advisor, *stage_cards,
                checkpoint_card(runs),
                ranking_card(runs), machines_card(runs, hardware), collectives_card(bench, runs), loss_card(runs),
                left_out_card(left_out)]
    sections = [s for s in sections if s is not None]
    out_dir = os.path.dirname(os.path.abspath(html_path))
    os.makedirs(out_dir, exist_ok=True)
    versions = _versions(runs)
    with open(html_path, "w") as fh:
        fh.write(render_html(sections, frame, out_dir, versions))
    with open(md_path, "w") as fh:
        fh.write(render_markdown(sections, frame, out_dir, versions))
    return left_out


def report_rule(metrics_paths, advice_paths, declared, html_path, md_path, ignored=()) -> list[dict]:
    """Rule report (scripts/report.py): the runs the summary accepts, reading only the rule's
    declared inputs (`declared`, distlab.report.inputs); returns what was left out (`ignored`:
    results folders the workflow could not read, distlab.report.collect.shared_metrics_paths)."""
    runs, rejected = load_checked_runs(list(metrics_paths), declared=declared)
    return write_report(runs, html_path, md_path, advice_paths=list(advice_paths),
                        left_out=list(ignored) + rejected, declared=declared)
