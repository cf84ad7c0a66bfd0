"""Stage 3 - DeepSpeed ZeRO: per-rank model-state memory by stage, measured vs formula
(distlab.report.cards.zero_memory), the budget, offload and DDP-parity goals."""
from __future__ import annotations

from distlab.report.held_out import eval_sentence
from distlab.report.cards import (COMPARED, DOUBTFUL, FAILED, NOT_RUN, PASSED, Card, Figure, Goal, Table, load_cell,
                                  metrics_link, noise_cause, ok_runs, phase_peak_table)
from distlab.report.cards.parity import NOT_COMPARED, gap_sentence, parity_rows
from distlab.report.cards.zero_memory import GAP_LIMIT, MIB, gap_note, memory_figure, memory_rows
from distlab.report.plots import loss_curves
from distlab.report.report_run import ReportRun

# Its lesson (cards.parity.lesson_goal): the stage, and whether its runs must train what DDP trains.
LESSON = ("deepspeed", True)

GOAL_TABLE = "ZeRO stage memory table, measured vs formula (ZeRO on 2+ devices, memory measured)"
GOAL_BUDGET = "ZeRO-3 ran what a single device could not, under the same per-rank memory budget"
GOAL_OFFLOAD = "Offload slowdown measured (same model and batch, with and without offload)"


def deepspeed_runs(runs: list[ReportRun]) -> list[ReportRun]:
    """Successful runs a DeepSpeed engine really ran (the label alone is not trusted)."""
    return [r for r in ok_runs(runs, "deepspeed") if r.spec.strategy == "deepspeed"
            and (r.as_built or {}).get("deepspeed", {}).get("engine") == "DeepSpeedEngine"]


def budget_goal(runs: list[ReportRun]) -> Goal:
    """A 1-device run out of memory under the budget and a ZeRO-3 run on 2+ devices that finished
    under the same budget, on the same model. The budget is enforced per rank process
    (distlab.runtime.memory: CUDA allocator fraction, CPU RSS watchdog); a run recorded before CPU
    enforcement is only compared, and says so. Passed only where both verdicts are enforced."""
    budgeted = [r for r in runs if r.stage == "deepspeed" and r.spec.memory_budget_gib]
    single, sharded = [], []
    for run in budgeted:
        spec = run.spec
        if spec.world_size == 1:
            if run.status == "oom":
                single.append((run, "ran out of memory under the enforced budget (status oom)", True))
            elif run.status == "ok":
                verdict = run.memory.per_rank[0].get("budget") or {}
                if verdict and not verdict["fits"]:
                    how = "enforced" if verdict["enforced"] else "compared, not enforced (CPU)"
                    single.append((run, f"needed {verdict['measured_bytes'] / MIB:.1f} MiB "
                                        f"({verdict['measured_what']}) > budget {verdict['bytes'] / MIB:.1f} MiB, "
                                        f"{how}", verdict["enforced"]))
        elif run.status == "ok" and spec.deepspeed.zero_stage == 3 and spec.strategy == "deepspeed":
            verdicts = [m.get("budget") for m in run.memory.per_rank]
            if verdicts and all(v and v["fits"] for v in verdicts):
                worst = max(v["measured_bytes"] for v in verdicts)
                if verdicts[0]["enforced"]:
                    why = (f"{run.as_built.world_size} ranks finished under the enforced budget of "
                           f"{verdicts[0]['bytes'] / MIB:.1f} MiB per rank "
                           f"({verdicts[0].get('how', 'how not recorded').split(' (')[0]}); "
                           f"largest rank {worst / MIB:.1f} MiB "
                           f"({verdicts[0].get('measured_what', 'measure not recorded')})")
                else:
                    why = (f"{run.as_built.world_size} ranks, largest rank {worst / MIB:.1f} MiB <= budget "
                           f"{verdicts[0]['bytes'] / MIB:.1f} MiB, compared, not enforced")
                sharded.append((run, why, verdicts[0]["enforced"]))
    if not budgeted:
        return Goal("bonus", GOAL_BUDGET, NOT_RUN, "no DeepSpeed run with memory_budget_gib")
    pairs = [(s, z) for s in single for z in sharded
             if s[0].machine == z[0].machine
             and s[0].spec.memory_budget_gib == z[0].spec.memory_budget_gib
             and s[0].spec.model == z[0].spec.model]
    if not pairs:
        return Goal("bonus", GOAL_BUDGET, FAILED,
                    f"{len(single)} single-device run(s) over budget, {len(sharded)} ZeRO-3 run(s) within it: "
                    "no pair on one machine with the same budget and model")
    # Passed only where an allocator held both runs to the budget; a limit compared after the
    # fact shows the arithmetic, not that the run could not have exceeded it.
    (one, one_why, one_enforced), (zero, zero_why, zero_enforced) = max(pairs, key=lambda p: p[0][2] and p[1][2])
    enforced = one_enforced and zero_enforced
    return Goal("bonus", GOAL_BUDGET, PASSED if enforced else COMPARED,
                f"{one.experiment}: {one_why}; {zero.experiment}: {zero_why}"
                + ("" if enforced else ". The budget was compared with the measured memory after the run, not "
                   "enforced by an allocator, so this does not show the runs could not exceed it"),
                [metrics_link(one), metrics_link(zero)])


def weights_read(run: ReportRun) -> str:
    """How rank 0 got its weights, from as_built.deepspeed.load (ZeRO-3) or the stage (0-2)."""
    load = run.as_built.deepspeed.get("load")
    if run.as_built.deepspeed.zero_stage != 3:
        return "whole model (from_pretrained)"
    if not load:
        return "not recorded"
    if "bytes_read" in load:
        return f"its partitions: {load['bytes_read'] / MIB:.1f} MiB"
    return f"whole state dict (transformers' ZeRO-3 route: {load.get('why', '')})"


def offload_pairs(ds_runs: list[ReportRun]) -> list[tuple[ReportRun, ReportRun]]:
    def key(r):
        s = r.spec
        return (r.machine, s.deepspeed.zero_stage, s.world_size, s.micro_batch, s.grad_accum,
                s.seq_len, s.precision, s.method, s.get("model", "default"),
                s.deepspeed.get("zero3_profile", "auto"))

    plain = {key(r): r for r in ds_runs if r.as_built.deepspeed.offload_optimizer == "none"
             and r.as_built.deepspeed.offload_param == "none"}
    return [(plain[key(r)], r) for r in ds_runs if key(r) in plain and r is not plain[key(r)]
            and "none" != r.as_built.deepspeed.offload_optimizer]


def offload_goal(plain: ReportRun, off: ReportRun) -> Goal:
    """The offload slowdown, measured: passed at 1x or slower; doubtful below 1 (offload adds
    copies and moves the optimizer step to the host; it cannot make a step faster), with the
    likely cause from the runs' noise records."""
    slow = off.timing.step_time_s.median / plain.timing.step_time_s.median
    text = (f"{off.experiment} median step {off.timing.step_time_s.median * 1000:.0f} ms vs "
            f"{plain.experiment} {plain.timing.step_time_s.median * 1000:.0f} ms: {slow:.2f}x")
    links = [metrics_link(plain), metrics_link(off)]
    if slow < 1:
        where = " (on CPU ranks both keep their state in host memory: the two should tie)" \
            if off.spec.device == "cpu" else ""
        return Goal("bonus", GOAL_OFFLOAD, DOUBTFUL,
                    f"{text}: offload FASTER than none, which offload cannot be{where}; {noise_cause([plain, off])}",
                    links)
    return Goal("bonus", GOAL_OFFLOAD, PASSED, text, links)


def ddp_parity(ds_runs: list[ReportRun], runs: list[ReportRun]) -> list[dict]:
    """Loss vs a DDP run that trained the same samples the same way (parity.ddp_twin)."""
    rows = parity_rows(ds_runs, runs, "DeepSpeed run")
    optimizer = {r.experiment: r.as_built.deepspeed.basic_optimizer for r in ds_runs}
    return [dict(row, optimizer=optimizer[row["DeepSpeed run"]]) for row in rows]


def parity_note(parity: list[dict]) -> str:
    """What the measured loss gaps vs DDP show, run by run (no claim beyond them)."""
    offload = " and offload" if any("off" in r["DeepSpeed run"] for r in parity) else ""
    return gap_sentence(parity, "DeepSpeed run", f"ZeRO sharding{offload}", "DeepSpeed")


def build(runs: list[ReportRun]) -> Card:
    import pandas as pd

    card = Card(3, "Stage 3 - DeepSpeed ZeRO")
    ds_runs = deepspeed_runs(runs)
    rows = memory_rows(ds_runs)
    multi = [r for r in rows if r["ranks"] >= 2]
    stages = sorted({r["ZeRO stage"] for r in multi})
    if len(stages) >= 2:
        plain = {}
        for r in multi:
            if r["of it offloaded (MiB)"] == 0:
                # Per model too (params (Psi)): a run on a model.extra model is not a stage of another's.
                plain.setdefault((r["machine"], r["ranks"], r["precision"], r["params (Psi)"]), {})[r["ZeRO stage"]] = r
        shrinks = all([g[s]["measured state (MiB/rank)"] for s in sorted(g)] ==
                      sorted((g[s]["measured state (MiB/rank)"] for s in g), reverse=True) for g in plain.values())
        worst = max(multi, key=lambda r: abs(r["_gap"]))
        card.goals.append(Goal("minimal", GOAL_TABLE, PASSED if shrinks else FAILED,
                               f"ZeRO stages {stages} ran on 2+ ranks with per-rank model state measured; "
                               f"state {'shrinks' if shrinks else 'does NOT shrink'} stage by stage; largest gap vs "
                               f"formula {worst['_gap']:+.1%} ({worst['experiment']})",
                               [metrics_link(r["_run"]) for r in multi]))
    else:
        card.goals.append(Goal("minimal", GOAL_TABLE, FAILED if ds_runs else NOT_RUN,
                               "needs DeepSpeed runs of at least two ZeRO stages on 2+ ranks"))
    card.goals.append(budget_goal(runs))
    pairs = offload_pairs(ds_runs)
    if pairs:
        plain, off = pairs[0]
        card.goals.append(offload_goal(plain, off))
        card.tables.append(Table("Offload slowdown", pd.DataFrame([{
            "run": r.experiment, "offload (opt/param)":
                f"{r.as_built.deepspeed.offload_optimizer}/{r.as_built.deepspeed.offload_param}",
            "median step (ms)": round(r.timing.step_time_s.median * 1000, 1),
            "step p25-p75 (ms)": f"{r.timing.step_time_s.p25 * 1000:.1f}-"
                                 f"{r.timing.step_time_s.p75 * 1000:.1f}",
            "tokens/s": round(r.throughput.tokens_per_s, 1),
            "machine during timing": load_cell(r)} for p in pairs for r in p]),
            "median and interquartile range of the optimizer-step wall time (max over ranks) after warm-up"))
    else:
        card.goals.append(Goal("bonus", GOAL_OFFLOAD, NOT_RUN,
                               "needs a ZeRO run with offload and the same run without"))
    if rows:
        frame = pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows])
        card.tables.append(Table("Per-rank model state by ZeRO stage", frame, (
            "measured: distinct tensor storages of the largest rank (params incl. ZeRO-3 partitions, grads and ZeRO "
            "grad buffers, Adam state and fp32 master partitions), largest snapshot after a backward of the last "
            "step; offloaded state counted with its category. Formula: bytes/param (weights, grads, optimizer) of "
            "the ZeRO paper, 2+2+12 in mixed precision; in fp32 4+4+12 (ZeRO 1-3 keep an fp32 master partition), "
            "4+4+8 unsharded at stage 0. Estimator: DeepSpeed's estimate_zero2/zero3_model_states_mem_needs "
            "(device bytes; it assumes 16-bit weights and grads, +4 bytes x largest layer at stage 3).")))
        card.figures.append(Figure("Per-rank model state: measured, formula, estimator", memory_figure(rows),
                                   "bars of the table above"))
        for r in rows:
            if abs(r["_gap"]) > GAP_LIMIT:
                card.notes.append(f"{r['experiment']}: {r['gap vs formula']} vs formula: "
                                  f"{gap_note(r['_run'], r['_measured'], r['_expected'])}.")
            est = r["_estimator"].get("device_bytes")
            if est and r["precision"] == "fp32":
                card.notes.append(f"{r['experiment']}: DeepSpeed's estimator counts 2-byte weights and grads "
                                  f"(mixed precision); this fp32 run holds 4-byte ones, so the estimator is a "
                                  f"lower bound here ({r['measured on device vs estimator']} measured on device).")
    parity = ddp_parity(ds_runs, runs)
    if parity:
        card.tables.append(Table("Loss vs DDP (same seed, data, global batch, fp32)", pd.DataFrame(parity),
                                 "max absolute difference of the mean training loss per optimizer step"))
    if parity:
        card.notes.append(parity_note(parity))
    elif ds_runs:
        card.notes.append(NOT_COMPARED.format(what="ZeRO"))
    if ds_runs:
        unmeasured = [r for r in ds_runs if r.timing.comm_inflight_s_per_step.median is None]
        card.notes.append("DeepSpeed's engine owns gradient accumulation (engine.backward scales by 1/GAS, "
                          "engine.step updates only on the boundary)."
                          + (f" Communication time was not measured for {len(unmeasured)} of {len(ds_runs)} "
                             f"DeepSpeed run(s): {unmeasured[0].experiment}'s record says "
                             f"\"{unmeasured[0].timing.get('comm_how', '')}\"." if unmeasured else ""))
        budgets = [m["budget"] for r in ds_runs for m in r.memory.per_rank if m.get("budget")]
        if budgets:
            enforced = sorted({b["how"] for b in budgets if b["enforced"]})
            compared = sum(1 for b in budgets if not b["enforced"])
            card.notes.append("Memory budgets: "
                              + ("; ".join(f"enforced by {how}" for how in enforced) or "none enforced")
                              + (f"; {compared} rank(s) only compared after the run (not enforced)" if compared
                                 else "") + ". A run past an enforced budget ends with status oom.")
        card.tables.append(phase_peak_table(ds_runs, "Per-rank peak memory: load, training and save phases", lambda r: {
            "ZeRO stage": r.as_built.deepspeed.zero_stage, "weights read by rank 0": weights_read(r)}))
        card.figures.append(Figure("Loss curves", loss_curves(ds_runs, "Stage 3 loss"),
                                   "mean training loss over data-parallel ranks per optimizer step"))
    card.notes.append(eval_sentence([r for r in runs if r.stage == "deepspeed"]))  # base vs tuned eval loss
    return card
