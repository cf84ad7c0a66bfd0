"""Which DDP run another strategy's losses can be set beside: one that read the same samples and
trained them the same way. Stages 3, 4 and 6 all ask this; one rule answers it, so no card
compares a run with a DDP run of another recipe and reports the recipe's gap as the strategy's."""
from __future__ import annotations

from distlab.report.cards import FAILED, NOT_RUN, PASSED, Goal
from distlab.report.report_run import ReportRun

# Max |loss diff| vs DDP below which a card says sharding left fp32 training unchanged (float
# summation order moves the loss by ~1e-6 here); above it the card says it did not.
PARITY_TOLERANCE = 1e-4
NOT_COMPARED = ("Loss parity not compared: no DDP run (sampler on) trained the same samples the same way (seed, "
                "data, global batch, model, precision, LR schedule and warm-up, clipping, weight decay), so a "
                "loss gap would measure the recipe, not {what}.")


def training_recipe(run: ReportRun) -> tuple:
    """What decides a run's losses step by step beyond its strategy: machine, seed, data, global
    batch, model, precision, method and the optimization recipe (LR, its schedule and warm-up,
    clipping, weight decay; the step count too where the schedule depends on it)."""
    s = run.spec
    schedule = s.get("lr_schedule") or "constant"
    return (run.machine, s.seed, s.get("dataset"), s.seq_len, s.precision, s.lr, s.get("weight_decay"),
            s.method, run.throughput.samples_per_step, run.section("parameters").total, schedule,
            s.get("lr_warmup_steps") or 0, s.get("max_grad_norm") or 0.0,
            None if schedule == "constant" else s.steps)


def ddp_twin(run: ReportRun, runs: list[ReportRun]) -> ReportRun | None:
    """The first finished DDP run (DistributedSampler on) with `run`'s training recipe."""
    key = training_recipe(run)
    for other in runs:
        o = other.spec
        if other is not run and other.status == "ok" and o.strategy == "ddp" \
                and o.sampler == "distributed" and training_recipe(other) == key:
            return other
    return None


def loss_gap(run: ReportRun, baseline: ReportRun) -> tuple[float, int]:
    """Largest per-step |loss difference| over the steps both recorded, and how many."""
    pairs = [(a, b) for a, b in zip(run.loss.per_step, baseline.loss.per_step)
             if a is not None and b is not None]
    return (max(abs(a - b) for a, b in pairs) if pairs else float("nan")), len(pairs)


def parity_rows(runs: list[ReportRun], everyone: list[ReportRun], label: str) -> list[dict]:
    """One row per run that has a DDP twin: the twin, steps compared, the largest gap."""
    rows = []
    for run in runs:
        twin = ddp_twin(run, everyone)
        if twin is not None:
            gap, steps = loss_gap(run, twin)
            rows.append({label: run.experiment, "DDP run": twin.experiment, "steps compared": steps,
                         "max |loss diff|": f"{gap:.2e}", "precision": run.spec.precision})
    return rows


def gap_sentence(rows: list[dict], label: str, sharding: str, library: str) -> str:
    """What the measured loss gaps vs DDP show, run by run (no claim beyond them)."""
    worst = max(rows, key=lambda r: float(r["max |loss diff|"]))
    gap = float(worst["max |loss diff|"])
    over = [r[label] for r in rows if float(r["max |loss diff|"]) > PARITY_TOLERANCE]
    steps = min(r["steps compared"] for r in rows)
    head = (f"Loss parity: the largest gap vs DDP is {gap:.1e} ({worst[label]} vs {worst['DDP run']}) "
            f"over {steps}+ steps of {len(rows)} run(s). ")
    if not over:
        fp32 = "fp32 " if all(r.get("precision") == "fp32" for r in rows) else ""
        return head + (f"Every run is within {PARITY_TOLERANCE:g} of DDP: on these runs {sharding} left {fp32}"
                       "training unchanged up to float summation order.")
    return head + (f"{len(over)} run(s) differ from DDP by more than {PARITY_TOLERANCE:g} ({', '.join(over)}): "
                   f"on these runs {library} did NOT reproduce DDP's training.")


GOAL_LESSON = "Every run trains what DDP trains on the same recipe, and every validated checkpoint passed"


def lesson_goal(stage: str, runs: list[ReportRun], compare_with_ddp: bool) -> Goal:
    """A stage has not taught its lesson while one of its runs missed loss parity with its DDP twin
    (compare_with_ddp: the sharding and model-parallel stages, whose runs must train what DDP
    trains) or failed its checkpoint validation; the overview then shows the stage failed."""
    mine = [r for r in runs if r.stage == stage]
    rows = parity_rows([r for r in mine if r.status == "ok" and r.spec.strategy != "ddp"], runs,
                       "run") if compare_with_ddp else []
    off = [f"{r['run']} vs {r['DDP run']} by {r['max |loss diff|']}" for r in rows
           if not float(r["max |loss diff|"]) <= PARITY_TOLERANCE]
    validated = [r for r in mine if r.validation]
    invalid = [f"{r.experiment} ({r.validation.get('reason') or 'failed'})" for r in validated
               if not r.validation.get("passed")]
    if off or invalid:
        return Goal("minimal", GOAL_LESSON, FAILED, "; ".join(
            ([f"loss differs from DDP by more than {PARITY_TOLERANCE:g}: " + ", ".join(off)] if off else []) +
            (["checkpoint validation failed: " + ", ".join(invalid)] if invalid else [])))
    if not rows and not validated:
        return Goal("minimal", GOAL_LESSON, NOT_RUN, "no run of this stage had a DDP twin or a validated checkpoint")
    return Goal("minimal", GOAL_LESSON, PASSED,
                f"{len(rows)} run(s) within {PARITY_TOLERANCE:g} of their DDP twin; {len(validated)} checkpoint "
                "validation(s) passed")
