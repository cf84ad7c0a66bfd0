"""The milestone report: where you stand (overview), what to run next (advisor), one card per
roadmap stage, then what spans stages (distlab.report.cards.across): strategy ranking, machines
side by side, collective bandwidth with the data-parallel break-even batch, loss curves.
Self-contained HTML (plots embedded, readable on a phone, printable) and Markdown
(distlab.report.render).

Its door is read_inputs: every file the report shows is read there, once, and only when rule
report declares it (distlab.report.inputs); the cards are functions of ReportInputs and open no
file (tests/test_report_honesty.py).
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field, replace

from distlab.records.memory_phases import human, unit_for
from distlab.records.memory_check import TOLERANCE as MEMORY_TOLERANCE, check_memory_estimates, recorded_row
from distlab.report.cards import (COMPARED, DOUBTFUL, FAILED, NOT_RUN, PASSED, Card, Goal, Table, all_cards, is_busy)
from distlab.report.cards.across import (card_noting_missing, collectives_card, loss_card, machines_card,
                                         ranking_card)
from distlab.report.cards.checkpoint_table import checkpoint_card
from distlab.report.cards.parity import GOAL_LESSON
from distlab.report.collect import (COLLECTIVES_SCHEMA_VERSION, HARDWARE_SCHEMA_VERSION, ResultsError,
                                    attach_machine_records, clear_winner, load_checked_runs, load_runs,
                                    machine_files, read_json)
from distlab.report.report_run import ReportRun
from distlab.report.render import render_html, render_markdown


def overview_card(cards: list[Card], runs: list[ReportRun], advice: dict) -> Card:
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
    # First: a stage whose runs did not train what DDP trains, or whose checkpoints failed
    # validation, has not taught its lesson, whatever its other goals say.
    unsound = [f"{c.title}: {g.evidence}" for c in cards for g in c.goals if g.text == GOAL_LESSON
               and g.status == FAILED]
    if unsound:
        card.notes.append("NOT SOUND: " + " | ".join(unsound))
    card.notes.extend(headline(runs, advice))
    card.notes.append(busy_note(runs))
    if len(frame):
        done = int((frame[["minimal", "bonus"]] == PASSED).sum().sum())
        card.notes.append(f"{done} of {2 * len(frame)} stage goals passed from {len(runs)} measured run(s) "
                          f"({sum(r.status == 'ok' for r in runs)} ok, "
                          f"{sum(r.status == 'oom' for r in runs)} out of memory).")
    card.tables.append(Table("Roadmap goals", frame, f"{PASSED} / {FAILED} / {NOT_RUN} / {COMPARED} (a limit the "
                                                     f"runs were compared with, not held to) / {DOUBTFUL} (a figure "
                                                     "the setup cannot produce, shown with its likely cause), "
                                                     "computed from the runs below"))
    return card


def headline(runs: list[ReportRun], advice: dict) -> list[str]:
    """What to run on each machine (the advisor's pick and why) and the measured evidence: the
    tokens/s of every strategy on the most common same-work comparison of that machine."""
    lines = []
    for machine in sorted(set(advice) | {r.machine for r in runs}):
        a = advice.get(machine)
        text = (f"Run {a['recommendation_label']} on {machine}: {a['reasons'][0]}." if a else
                f"{machine}: no advice (rule `advise` did not run for it).")
        timed = [r for r in runs if r.machine == machine and r.throughput_spread
                 and r.spec.sampler == "distributed" and r.spec.model == "default"]
        groups = {}
        for run in timed:
            s = run.spec
            groups.setdefault((run.throughput.samples_per_step, s.seq_len, s.method, s.precision),
                              []).append(run)
        if groups:
            (batch, seq, method, precision), same = max(groups.items(), key=lambda kv: len(kv[1]))
            same.sort(key=lambda r: -r.throughput_spread.median)
            text += (f" Measured here on the same work ({method} fine-tuning, global batch {batch} x {seq} tokens, "
                     f"{precision}), tokens/s: " + ", ".join(
                         f"{r.experiment} {r.throughput_spread.median:.0f}" + (" (BUSY)" if is_busy(r) else "")
                         for r in same[:6]) + (f" and {len(same) - 6} more" if len(same) > 6 else "") + ".")
            picked = [r for r in same if a and recorded_row(r.metrics) == a["recommendation"]]
            if picked and same[0] is not picked[0]:
                text += (f" The fastest here, {same[0].experiment}, ran "
                         f"{same[0].throughput_spread.median / picked[0].throughput_spread.median:.2f}x "
                         f"the best run of the recommended kind ({picked[0].experiment}): the "
                         "advice picks by memory fit and the roadmap's rules, not by this machine's speed"
                         + ("; the spreads overlap, so this machine does not tell them apart."
                            if not clear_winner(same[0], picked[0]) else "."))
        if a:
            checked = check_memory_estimates([r.metrics for r in runs if r.machine == machine])
            if checked:
                right = sum(c["verdict"] == "right" for c in checked)
                text += (f" The advisor's memory estimate was right (within {MEMORY_TOLERANCE:.0%}) for "
                         f"{right} of {len(checked)} run(s) measured here.")
        lines.append(text)
    return lines


def busy_note(runs: list[ReportRun]) -> str:
    """How many runs were timed on a busy machine (distlab.runtime.noise), named: their speed figures
    include waiting for a core and say nothing about the strategy."""
    timed = [r for r in runs if r.status == "ok"]
    recorded = [r for r in timed if (r.noise or {}).get("busy") is not None]
    busy = [r for r in recorded if is_busy(r)]
    if not recorded:
        return "Machine load during the timed steps was not recorded for these runs: speed figures are unqualified."
    if not busy:
        return (f"All {len(recorded)} timed run(s) ran on a quiet machine (no other process needed the cores they "
                "left free): their speed figures are the strategies' own.")
    return (f"BUSY MACHINE: {len(busy)} of {len(recorded)} run(s) were timed while other processes needed the cores "
            f"they had left free ({', '.join(r.experiment for r in busy)}): their step times include waiting for "
            "a core, so their speed figures (marked BUSY in the tables) are inflated by an unknown amount; rerun them "
            "on a quiet machine before comparing speeds.")


def advisor_card(advice: dict, runs: list[ReportRun], left_out: list[dict] | None = None) -> Card:
    card = card_noting_missing(90, "Advisor: what to run on this hardware", advice,
                               "No advice.json found (rule `advise`); run `snakemake advise`.")
    for machine, a in sorted(advice.items()):
        try:
            # The advice sizes the causal LM: runs counted in tokens (a text-to-image run has its own advisor).
            advise_machine(card, machine, a, [r for r in runs if r.machine == machine and r.unit == "token"])
        except ValueError as error:  # transformers refuses the model its config_json describes
            if left_out is not None:
                left_out.append({"path": f"{machine}/advice.json", "reason": f"{machine}/advice.json: {error}"})
    return card


def advise_machine(card: Card, machine: str, a: dict, runs: list[ReportRun]) -> None:
    """One machine's advice: the recommendation, the estimate table, the check against its runs."""
    import pandas as pd

    card.notes.append(f"{machine}: recommended {a['recommendation_label']}. " + " ".join(
        f"{r[0].upper()}{r[1:]}." for r in a["reasons"]))
    unit, scale = unit_for(max(r["total_bytes"] for r in a["estimates"]))
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
                             f"{human(a['usable_bytes_per_device'])} usable each)", frame,
                             " ".join(a["how"].split())))
    if a.get("time"):  # a named box: the strategies that fit, ranked by predicted step time (advisor_time)
        from distlab.records.advice import card_rows

        ranking, refs = card_rows(a["time"])
        link = a["time"]["link"]
        if a["time"].get("decides"):
            card.notes.append(f"{machine}'s box ({link['label']}): {a['time']['decides']}.")
        card.tables.append(Table(f"Time ranking of the box advised on {machine} ({link['label']}): predicted "
                                 "step, fastest first", pd.DataFrame(ranking), " ".join(a["time"]["how"].split())))
        if refs:
            card.tables.append(Table(f"Published references beside the prediction ({link['label']})",
                                     pd.DataFrame(refs), "measured by others on the named hardware, not on this "
                                     "machine; predicted/published = this box's prediction over their figure"))
    checked = check_memory_estimates([r.metrics for r in runs])  # the estimate each run recorded before its first step
    if checked:
        wrong = [c for c in checked if c["verdict"] != "right"]
        key = ["experiment", "verdict", "measured/estimated", "where"]
        frame = pd.DataFrame(checked)
        frame = frame[key + [c for c in frame.columns if c not in key]]
        card.tables.append(Table(f"Estimate vs measured on {machine}", frame,
                                 "model state = params + grads (DDP's buckets included) + optimizer bytes "
                                 "the rank held at the last step, offloaded ones too, counted from its "
                                 "tensors; right = the total and each of params, grads and optimizer within "
                                 f"{MEMORY_TOLERANCE:.0%} ('where' names a part that is not). Activations: "
                                 "the bytes autograd held at the end of one micro-batch's forward on rank 0 "
                                 "(saved-tensor hooks) vs distlab.runtime.activations' estimate (data-parallel "
                                 "strategies; peak RSS, which includes the interpreter and libraries, is not "
                                 "compared)."))
        card.notes.append(f"The estimate was wrong for {len(wrong)} of {len(checked)} run(s)"
                          + (": " + "; ".join(f"{c['experiment']} ({c['where'] or 'total'})" for c in wrong)
                             if wrong else "."))
    step_time_table(card, machine, runs)
    unchecked = sorted(r.experiment for r in runs if r.status == "ok" and not r.section("memory_estimate")
                       and r.spec.task == "causal-lm")
    if unchecked:
        card.notes.append(f"Not checked against the estimate: {', '.join(unchecked)} (no estimate recorded before "
                          "the first step: a strategy without a formula, or a run of an older distlab).")


def step_time_table(card: Card, machine: str, runs: list[ReportRun]) -> None:
    """Predicted against measured step time for every run of the machine (distlab.tools.step_time)."""
    import pandas as pd

    from distlab.records.predictions import TOLERANCE, check_step_times, step_time_verdict

    rows = check_step_times([r.metrics for r in runs])
    if not rows:
        return
    status, evidence = step_time_verdict(rows)
    card.goals.append(Goal("minimal", f"Step time predicted before each run, within {TOLERANCE:.0%} of the measured "
                                      f"median for at least 80% of the runs timed on a quiet machine ({machine})",
                           {"passed": PASSED, "failed": FAILED}.get(status, NOT_RUN), evidence))
    card.tables.append(Table(
        f"Step time: predicted before the run vs measured on {machine}", pd.DataFrame(rows),
        "predicted = compute (the step's kernels at the model's shapes, timed by the compute probe) + exposed "
        "communication (each collective at its size from collectives.json) + sharding (ZeRO-3 and FSDP: the "
        "wrapper's hooks and copies, the toy-width model wrapped as the run wraps it, timed by the probe) + "
        "optimizer and offload copies + pipeline bubble, made by rank 0 before the first step (metrics.json "
        "prediction, its terms and their inputs); measured = the median step after warm-up. A run timed on a "
        "busy machine, or predicted from a compute probe timed on one (the probe's own noise record, the runs' "
        "rule: 'probe timed on a busy machine'), is shown, not scored. 'furthest off' compares communication with "
        "the time the strategy's collectives were in flight where it times them, and the rest of the step with "
        "the rest of the prediction."))


def _versions(runs: list[ReportRun]) -> str:
    seen = {}
    for run in runs:
        v = run.section("versions") or {}
        seen.setdefault(run.machine, ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "deepspeed",
                                                                           "accelerate", "ray") if v.get(k)))
    return " ".join(f"Versions on {m}: {v}." for m, v in sorted(seen.items()))


def left_out_card(left_out: list[dict]) -> Card | None:
    """Every file the report did not trust, named with the reason (collect's schema checks)."""
    if not left_out:
        return None
    card = Card(95, "Files left out of this report")
    card.notes += [item["reason"] for item in left_out]
    return card


@dataclass
class ReportInputs:
    """Everything the milestone report shows, read once at its door (read_inputs): the cards
    are functions of this and open no file."""
    runs: list[ReportRun]  # collect.load_run: each metrics.json with the declared files beside it
    summary: list[dict]  # summary.csv's rows (rule summary), for the header's run count and machines
    hardware: dict = field(default_factory=dict)  # {machine: hardware.json}
    collectives: dict = field(default_factory=dict)  # {machine: collectives.json}
    advice: dict = field(default_factory=dict)  # {machine: advice.json}
    left_out: list[dict] = field(default_factory=list)  # files not trusted, {"path", "reason"}


def read_summary(path) -> list[dict]:
    """summary.csv's rows (rule summary wrote them from the same runs): the report does not
    recompute the table it depends on."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def read_inputs(runs: list[ReportRun], summary_path, advice_paths=(), left_out=None, declared=None) -> ReportInputs:
    """The report's door: the runs already loaded (collect.load_run reads each metrics.json
    once), summary.csv, and every machine-level file, read once; `declared`: the rule's inputs
    (distlab.report.inputs), the only files read. A machine file that fails its schema is named
    in left_out (after the runs the summary refused) and left out."""
    left_out = list(left_out or [])
    # Absolute folders: the cards' evidence links are made relative to the report's own folder.
    runs = [replace(run, folder=os.path.abspath(run.folder)) for run in runs]
    hardware = machine_files(runs, "hardware.json", HARDWARE_SCHEMA_VERSION, left_out, declared)
    bench = machine_files(runs, "collectives.json", COLLECTIVES_SCHEMA_VERSION, left_out, declared)
    # other machines' advice comes with their folders
    advice = machine_files(runs, "advice.json", 1, left_out, declared)
    runs = attach_machine_records(runs, left_out, declared)
    for path in advice_paths:
        try:
            a = read_json(path, "advice", 1, "advice")
        except ResultsError as error:
            left_out.append({"path": str(path), "reason": str(error)})
            continue
        advice[os.path.basename(os.path.dirname(os.path.abspath(path)))] = a
    return ReportInputs(runs, read_summary(summary_path), hardware, bench, advice, left_out)


def report_sections(inputs: ReportInputs) -> list[Card]:
    """The report's cards, in order, from its inputs alone (a card whose source file failed
    adds it to inputs.left_out, named on the last card)."""
    runs, advice = inputs.runs, inputs.advice
    stage_cards = all_cards(runs)
    advisor = advisor_card(advice, runs, inputs.left_out)
    sections = [overview_card(stage_cards, runs, advice), advisor, *stage_cards,
                checkpoint_card(runs),
                ranking_card(runs), machines_card(runs, inputs.hardware), collectives_card(inputs.collectives, runs),
                loss_card(runs), left_out_card(inputs.left_out)]
    return [s for s in sections if s is not None]


def write_report(inputs: ReportInputs, html_path, md_path) -> list[dict]:
    """Write both pages; returns the files left out ({"path", "reason"})."""
    sections = report_sections(inputs)
    out_dir = os.path.dirname(os.path.abspath(html_path))
    os.makedirs(out_dir, exist_ok=True)
    versions = _versions(inputs.runs)
    with open(html_path, "w") as fh:
        fh.write(render_html(sections, inputs.summary, out_dir, versions))
    with open(md_path, "w") as fh:
        fh.write(render_markdown(sections, inputs.summary, out_dir, versions))
    return inputs.left_out


def build_report(metrics_paths, summary_path, html_path, md_path, advice_paths=(), left_out=None,
                 declared=None) -> list[dict]:
    """Write both pages from these metrics.json files and their summary.csv (write_report says
    what it returns)."""
    inputs = read_inputs(load_runs(metrics_paths, declared), summary_path, advice_paths, left_out, declared)
    return write_report(inputs, html_path, md_path)


def report_rule(metrics_paths, summary_path, advice_paths, declared, html_path, md_path, ignored=()) -> list[dict]:
    """Rule report (scripts/report.py): the runs the summary accepts, reading only the rule's
    declared inputs (`declared`, distlab.report.inputs); returns what was left out (`ignored`:
    results folders the workflow could not read, distlab.report.collect.shared_metrics_paths)."""
    runs, rejected = load_checked_runs(list(metrics_paths), declared=declared)
    inputs = read_inputs(runs, summary_path, list(advice_paths), list(ignored) + rejected, declared)
    return write_report(inputs, html_path, md_path)
