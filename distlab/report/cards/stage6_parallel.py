"""Stage 6 - tensor and pipeline parallel: the model itself split across ranks.

Loss is compared with a DDP run that read the same samples per step and trained them the same
way (distlab.report.cards.parity); the pipeline bubble is the per-rank measurement the pipeline
strategy wrote (run_files/pipeline-rank<r>.json) next to the formula (p-1)/(m+p-1).
"""
from __future__ import annotations

import statistics

from distlab.report.held_out import eval_sentence
from distlab.report.cards import FAILED, NOT_RUN, PASSED, Card, Figure, Goal, Table, metrics_link, ok_runs
from distlab.report.cards.parity import ddp_twin, loss_gap
from distlab.report.plots import figure, loss_curves, to_png_b64
from distlab.report.report_run import ReportRun

# Its lesson (cards.parity.lesson_goal): the stage, and whether its runs must train what DDP trains.
LESSON = ("parallel", True)

# Same data, seed and global batch in fp32: only float reduction order differs. Measured
# differences are ~1e-5; anything past this is a real difference in the update.
LOSS_TOLERANCE = 1e-3


def parallel_runs(runs: list[ReportRun], strategy: str, wrapper: str) -> list[ReportRun]:
    return [r for r in ok_runs(runs, "parallel") if r.spec.strategy == strategy
            and wrapper in (r.as_built or {}).get("wrappers_found", [])]


def bubble_records(run: ReportRun) -> list[dict]:
    """run_files/pipeline-rank<r>.json, read by collect.load_run (a declared input)."""
    return run.pipeline_records or []


def stage_compute_ms(record: dict) -> float:
    """Median busy time of one stage per optimizer step, after the warm-up steps."""
    timed = record["per_step"][len(record["per_step"]) - record["idle_fraction"]["n"]:]
    return statistics.median(t["stage_compute_s"] for t in timed) * 1000 if timed else float("nan")


def parity_goal(tp: list[ReportRun], pp: list[ReportRun], runs: list[ReportRun], rows: list[dict]) -> Goal:
    text = "TP and PP losses match DDP at the same global batch"
    compared = []
    for run in tp + pp:
        twin = ddp_twin(run, runs)
        if twin is None:
            continue
        gap, _ = loss_gap(run, twin)
        compared.append((run, twin, gap))
        rows.append({"experiment": run.experiment, "DDP run": twin.experiment,
                     "steps": len(run.loss.per_step),
                     "max |loss - DDP loss|": f"{gap:.2e}", "last loss": round(run.loss.last, 4),
                     "DDP last loss": round(twin.loss.last, 4)})
    if not compared:
        return Goal("bonus", text, NOT_RUN,
                    "no DDP run that read the same samples and trained them the same way (parity.training_recipe)")
    worst = max(compared, key=lambda c: c[2])
    status = PASSED if worst[2] < LOSS_TOLERANCE else FAILED
    return Goal("bonus", text, status,
                f"{len(compared)} run(s) compared; worst max per-step gap {worst[2]:.2e} ({worst[0].experiment} vs "
                f"{worst[1].experiment}); tolerance {LOSS_TOLERANCE:g}", [metrics_link(c[0]) for c in compared])


def build(runs: list[ReportRun]) -> Card:
    import pandas as pd

    card = Card(6, "Stage 6 - Tensor and pipeline parallel")
    tp = parallel_runs(runs, "tp", "parallelize_module")
    pp = parallel_runs(runs, "pp", "PipelineStage")
    tried = [r for r in runs if r.stage == "parallel"]

    if tp:
        a = tp[0].as_built
        card.goals.append(Goal("minimal", "Tensor-parallel training ran with attention and MLP split", PASSED,
                               f"{tp[0].experiment}: {a['split_linears']} linear layers split over {a['tp_degree']} "
                               f"ranks ({', '.join(f'{k} {v}' for k, v in a['split_linears_per_layer'].items())}), "
                               f"{a['heads_per_rank']} attention heads per rank", [metrics_link(tp[0])]))
    else:
        card.goals.append(Goal("minimal", "Tensor-parallel training ran with attention and MLP split",
                               FAILED if any(r.spec.strategy == "tp" for r in tried) else NOT_RUN,
                               "no successful tensor-parallel run"))
    schedules = sorted({r.as_built.schedule for r in pp})
    if pp:
        card.goals.append(Goal("minimal", "Pipeline-parallel training ran, stages split by layers", PASSED,
                               f"{len(pp)} run(s), schedules {', '.join(schedules)}; e.g. {pp[0].experiment}: "
                               + "; ".join(f"stage {i} layers {s['layers']}"
                                           for i, s in enumerate(pp[0].as_built.stages)),
                               [metrics_link(r) for r in pp]))
    else:
        card.goals.append(Goal("minimal", "Pipeline-parallel training ran, stages split by layers",
                               FAILED if any(r.spec.strategy == "pp" for r in tried) else NOT_RUN,
                               "no successful pipeline-parallel run"))

    rows: list[dict] = []
    card.goals.append(parity_goal(tp, pp, runs, rows))
    if rows:
        card.tables.append(Table("Loss vs DDP", pd.DataFrame(rows),
                                 "max over optimizer steps of |mean loss - DDP mean loss|, same samples per step"))

    bubble_rows = []
    for run in pp:
        for rec in bubble_records(run):
            idle = rec["idle_fraction"]
            bubble_rows.append({"experiment": run.experiment, "schedule": run.as_built.schedule,
                                "stage (rank)": rec["stage"], "p stages": rec["stages"],
                                "m micro-batches": rec["microbatches"],
                                "measured idle fraction (median)": round(idle["median"], 3),
                                "idle p25-p75": f"{idle['p25']:.3f}-{idle['p75']:.3f}", "timed steps": idle["n"],
                                "stage compute / step (ms, median)": round(stage_compute_ms(rec), 1),
                                "formula (p-1)/(m+p-1)": round(rec["formula_bubble"], 3)})
    if bubble_rows:
        how = bubble_records(pp[0])[0]["how"]
        frame = pd.DataFrame(bubble_rows)
        card.tables.append(Table("Pipeline bubble: measured vs formula", frame, how))
        fig, ax = figure()
        labels = [f"{r['schedule'].replace('Schedule', '')} s{r['stage (rank)']}" for r in bubble_rows]
        ax.bar(range(len(labels)), frame["measured idle fraction (median)"], label="measured idle fraction")
        ax.scatter(range(len(labels)), frame["formula (p-1)/(m+p-1)"], color="black", zorder=3, label="formula")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of step idle")
        ax.legend(fontsize=7)
        card.figures.append(Figure("Pipeline bubble", to_png_b64(fig), how))
        card.goals.append(Goal("bonus", "Pipeline bubble measured next to (p-1)/(m+p-1)", PASSED,
                               f"{len(bubble_rows)} stage measurement(s) over {len(pp)} run(s); see the table",
                               [metrics_link(r) for r in pp]))
        card.notes.append("The measured idle fraction also holds point-to-point transfer time and, on shared CPU "
                          "cores, time the OS gave to other processes; the formula assumes equal stage times and "
                          "free communication: unequal stages (the last one also runs the LM head and the loss) "
                          "leave the faster stage waiting; compare the stage compute column.")
        above = [r for r in bubble_rows if r["measured idle fraction (median)"] > r["formula (p-1)/(m+p-1)"]]
        if above:
            card.notes.append(f"{len(above)} of {len(bubble_rows)} stage measurements sit above the formula.")
    else:
        card.goals.append(Goal("bonus", "Pipeline bubble measured next to (p-1)/(m+p-1)", NOT_RUN,
                               "no pipeline run with bubble records (pipeline-rank<r>.json)"))
    if tp or pp:
        card.figures.append(Figure("Loss curves", loss_curves(tp + pp, "Stage 6 loss"),
                                   "training loss per optimizer step (pipeline: from the last stage)"))
    card.notes.append(eval_sentence([r for r in runs if r.stage == "parallel"]))  # base vs tuned eval loss
    return card
