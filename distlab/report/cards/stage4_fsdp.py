"""Stage 4 - native FSDP2: a sharded fine-tune with a validated checkpoint, and FSDP full
shard next to DeepSpeed ZeRO-3 on the same model, data and global batch.

Everything comes from the runs' metrics.json (what fully_shard really did is under
`as_built`) and, for the checkpoint, from validation.json written by checkpoint validation.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from distlab.report.held_out import eval_sentence
from distlab.report.cards import (DOUBTFUL, FAILED, NOT_RUN, PASSED, Card, Figure, Goal, Table, is_busy, load_cell,
                                  metrics_link, noise_cause, ok_runs, phase_peak_table, tokens_per_s)
from distlab.report.cards.parity import NOT_COMPARED, gap_sentence, parity_rows
from distlab.report.collect import clear_winner
from distlab.report.plots import loss_curves, to_png_b64
from distlab.report.report_run import ReportRun

# Its lesson (cards.parity.lesson_goal): the stage, and whether its runs must train what DDP trains.
LESSON = ("fsdp", True)

GOAL_RUN = "FSDP fine-tune ran, checkpoint saved"
GOAL_VS = "ZeRO-3 vs FSDP throughput"
MIB = 2**20
# Single launches on a 2-core CPU machine move +-15% (issue 28's repeats): within this band, or
# with overlapping spreads, ZeRO-3 and FSDP full shard count as at parity.
PARITY_BAND = 1.15


def fsdp_runs(runs: list[ReportRun]) -> list[ReportRun]:
    """Successful FSDP runs (native or through Accelerate, spec fsdp.via) that fully_shard really
    wrapped: native runs record "FSDPModule", Accelerate's "FSDPModule (fully_shard)"."""
    return [r for r in ok_runs(runs, "fsdp") if r.spec.strategy == "fsdp"
            and any(w.startswith("FSDPModule") for w in (r.as_built or {}).get("wrappers_found", []))]


def sharding_text(run: ReportRun) -> str:
    """How the run's parameters were sharded, from what its record measured."""
    a = run.as_built
    if a.get("dtensor_parameters") is not None:
        return (f"{a['dtensor_parameters']} parameters sharded as {a['placements']} over {a['world_size']} ranks, "
                f"{a['fsdp_layers']} decoder layers as fully_shard units")
    shards = (a.get("accelerate") or {}).get("fsdp_sharded_modules")
    return (f"wrapped by {', '.join(a['wrappers_found'])} through Accelerate over {a['world_size']} ranks"
            + (f", {shards} fully_shard modules" if shards is not None else ""))


def validation(run: ReportRun) -> Mapping | None:
    return run.validation  # validation.json, read by collect.load_run (a declared input)


def global_batch(run: ReportRun) -> int:
    return run.throughput.samples_per_step


def comparable_key(run: ReportRun) -> tuple:
    s = run.spec
    # Micro-batch shape too: two passes of 2 are not the same work as one pass of 4.
    return (run.machine, s.device, s.world_size, s.micro_batch, s.grad_accum, s.seq_len,
            s.method, s.precision, s.get("model", "default"))


def is_full_shard(run: ReportRun) -> bool:
    fs = run.spec.fsdp
    return fs.reshard_after_forward and not fs.cpu_offload and fs.via == "native"


def is_plain_zero3(run: ReportRun) -> bool:
    ds = run.spec.deepspeed
    return (run.spec.strategy == "deepspeed" and ds.zero_stage == 3 and ds.offload_optimizer == "none"
            and ds.offload_param == "none")


def zero3_label(run: ReportRun) -> str:
    profile = run.spec.deepspeed.get("zero3_profile", "auto")
    return "DeepSpeed ZeRO-3" + (" (memory-lean)" if profile == "lean" else "")


def parity_goal(f: ReportRun, z: ReportRun) -> Goal:
    """FSDP full shard vs ZeRO-3 as DeepSpeed users configure it (profile auto): passed at parity
    (overlapping spreads, or within PARITY_BAND); beyond it doubtful when either run was timed on a
    busy machine, else failed: a measured gap the card's table and the ZeRO-3 config must explain."""
    ratio = tokens_per_s(f)[0] / tokens_per_s(z)[0]
    head = (f"{f.experiment} vs {z.experiment} ({f.machine}, {f.as_built.world_size} ranks, global "
            f"batch {global_batch(f)}): FSDP at {ratio:.2f}x ZeRO-3's median tokens/s")
    links = [metrics_link(f), metrics_link(z)]
    if not clear_winner(f, z) or 1 / PARITY_BAND <= ratio <= PARITY_BAND:
        return Goal("bonus", GOAL_VS, PASSED, f"{head}: at parity (spreads overlap or within {PARITY_BAND}x)", links)
    if is_busy(f) or is_busy(z) or not all((r.noise or {}).get("busy") is False for r in (f, z)):
        return Goal("bonus", GOAL_VS, DOUBTFUL, f"{head}: not at parity, {noise_cause([f, z])}", links)
    return Goal("bonus", GOAL_VS, FAILED, f"{head}: not at parity on a quiet machine, with ZeRO-3's config as "
                f"{z.experiment}'s run_files/deepspeed_config.json says", links)


def state_mib(run: ReportRun) -> float | None:
    """Largest per-rank model state (params + grads + optimizer) the run counted."""
    per_rank = (run.memory or {}).get("model_state_bytes_per_rank") or []
    totals = [sum(v for k, v in s.items() if isinstance(v, int)) for s in per_rank if s]
    return max(totals) / MIB if totals else None


def peak_mib(run: ReportRun) -> tuple[float | None, str]:
    per_rank = (run.memory or {}).get("per_rank") or []
    cuda = [m["cuda_max_allocated_bytes"] for m in per_rank if m.get("cuda_max_allocated_bytes") is not None]
    if cuda:
        return max(cuda) / MIB, "torch.cuda.max_memory_allocated"
    rss = [m["peak_rss_bytes"] for m in per_rank if m.get("peak_rss_bytes")]
    return (max(rss) / MIB, "peak RSS of the rank process") if rss else (None, "")


def phase_columns(run: ReportRun) -> dict:
    """Load-phase (process start -> first step), training-phase and save-phase (final eval,
    save, export) peaks of the largest rank."""
    from distlab.records.memory_phases import PHASES, phase_peaks

    peaks = phase_peaks(run.metrics)
    return {f"{phase.split('_')[0]} peak / rank (MiB)": round(peaks[phase] / MIB, 1) if peaks[phase] is not None
            else None for phase in PHASES}


def row(run: ReportRun, label: str) -> dict:
    st = run.timing.step_time_s
    tps, low, high = tokens_per_s(run)
    peak, peak_what = peak_mib(run)
    state = state_mib(run)
    return {"run": label, "experiment": run.experiment, "machine": run.machine,
            "ranks": run.as_built.world_size, "global batch": global_batch(run),
            "tokens/s": round(tps, 1), "tokens/s range": f"{low:.0f}-{high:.0f}",
            "median step (ms)": round(st.median * 1000, 1),
            "step p25-p75 (ms)": f"{st.p25 * 1000:.1f}-{st.p75 * 1000:.1f}",
            "model state / rank (MiB)": round(state, 2) if state is not None else None,
            "peak memory / rank (MiB)": round(peak, 1) if peak is not None else None,
            "peak measured as": peak_what, **phase_columns(run), "last loss": round(run.loss.last, 4),
            "machine during timing": load_cell(run)}


def trade_note(auto: ReportRun, lean: ReportRun) -> str:
    """What the memory-lean ZeRO-3 profile bought and cost, from the two runs' own figures:
    a direction the figures do not show (lean no leaner, or no slower) is said, not implied."""
    (fast, *_), (slow, *_) = tokens_per_s(auto), tokens_per_s(lean)
    peaks = [phase_columns(r)["training peak / rank (MiB)"] for r in (auto, lean)]
    memory = (f"training-phase peak {peaks[0]:.0f} -> {peaks[1]:.0f} MiB per rank" if None not in peaks
              else "training-phase peak not recorded")
    speed = (f"ran {fast / slow:.2f}x slower than" if fast >= slow
             else f"ran at {fast / slow:.2f}x the step time of")
    leaner = ""
    if None not in peaks and peaks[1] >= peaks[0]:
        leaner = (" On this model the lean profile saved no memory: the gathered copy the auto profile keeps is "
                  "small beside what a rank holds anyway; its saving shows on larger models (benchmarks/RESULTS.md, "
                  "benchmarks/memory_peaks.py).")
    return (f"ZeRO-3's trade, measured: the memory-lean profile ({lean.experiment}: nothing persistent, one layer "
            f"live, every parameter re-gathered for backward) {speed} the auto profile "
            f"({auto.experiment}: Hugging Face's auto sizes from the hidden size, DeepSpeed's 1e9 live limit) for "
            f"{memory}.{leaner}" + (" One of the two was timed on a busy machine: the speed ratio is not trustworthy."
                                    if is_busy(auto) or is_busy(lean) else ""))


def run_goal(runs: list[ReportRun], fsdp: list[ReportRun]) -> Goal:
    if not fsdp:
        tried = [r for r in runs if r.stage == "fsdp"]
        return Goal("minimal", GOAL_RUN, FAILED if tried else NOT_RUN,
                    f"{len(tried)} stage-4 run(s), none finished with sharded parameters" if tried
                    else "no FSDP experiment in the results")
    checked = [(r, validation(r)) for r in fsdp]
    passed = [r for r, v in checked if v and v.get("passed")]
    if passed:
        run = passed[0]
        return Goal("minimal", GOAL_RUN, PASSED,
                    f"{run.experiment}: {sharding_text(run)}; checkpoint saved and its validation passed",
                    [metrics_link(run), os.path.join(run.folder, "validation.json")])
    failed = [(r, v) for r, v in checked if v is not None]
    if failed:
        run, v = failed[0]
        bad = [name for name, c in (v.get("checks") or {}).items() if c.get("status") == "failed"]
        return Goal("minimal", GOAL_RUN, FAILED,
                    f"{run.experiment} trained, but checkpoint validation failed ({', '.join(bad) or 'see file'})",
                    [metrics_link(run), os.path.join(run.folder, "validation.json")])
    run = fsdp[0]
    saved = (run.section("checkpoint") or {}).get("status", "no record")
    return Goal("minimal", GOAL_RUN, NOT_RUN,
                f"{run.experiment} trained with sharded parameters (checkpoint save: {saved}), but checkpoint "
                "validation has not run, so the checkpoint part is not checked", [metrics_link(run)])


def build(runs: list[ReportRun]) -> Card:
    card = Card(4, "Stage 4 - FSDP (native FSDP2)")
    fsdp = fsdp_runs(runs)
    card.goals.append(run_goal(runs, fsdp))

    zero3 = [r for r in runs if r.status == "ok" and is_plain_zero3(r)]
    # Each FSDP full-shard run with the ZeRO-3 runs of the same work: the auto profile first (the
    # parity goal's), the memory-lean one beside it (the memory vs tokens/s trade).
    pairs = []
    for f in (r for r in fsdp if is_full_shard(r)):
        match = sorted((z for z in zero3 if comparable_key(z) == comparable_key(f)), key=zero3_label)
        if match:
            pairs.append((f, match))
    if pairs:
        import pandas as pd

        rows = []
        for f, matched in pairs:
            rows += [row(f, "FSDP full shard")] + [row(z, zero3_label(z)) for z in matched]
        frame = pd.DataFrame(rows)
        how = ("tokens/s = global tokens per step / median step time (max over ranks) after warm-up, range from "
               "the step-time spread; model state = params + grads + optimizer tensors a rank holds (local "
               "shards), counted on the last step; same machine, model, data, world size, micro-batch and "
               "gradient accumulation")
        card.tables.append(Table("ZeRO-3 vs FSDP full shard", frame, how))
        fig, (left, right) = _pair_axes()
        labels = [f"{r['run']}\n{r['experiment'][:28]}" for r in rows]
        colors = ["tab:blue" if r["run"].startswith("FSDP") else "tab:orange" for r in rows]
        left.bar(range(len(rows)), frame["tokens/s"], color=colors)
        left.set_ylabel("tokens/s")
        right.bar(range(len(rows)), frame["model state / rank (MiB)"].fillna(0), color=colors)
        right.set_ylabel("model state per rank (MiB)")
        for ax in (left, right):
            ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=20)
        card.figures.append(Figure("ZeRO-3 vs FSDP: throughput and per-rank model state", to_png_b64(fig), how))
        f, matched = pairs[0]
        card.goals.append(parity_goal(f, matched[0]))
        lean = [z for z in matched if z.spec.deepspeed.get("zero3_profile") == "lean"]
        if lean and matched[0] is not lean[0]:
            card.notes.append(trade_note(matched[0], lean[0]))
    else:
        missing = ("no FSDP full-shard run" if not any(is_full_shard(r) for r in fsdp) else
                   "no DeepSpeed ZeRO-3 run (no offload) with the same machine, world size, micro-batch, "
                   "gradient accumulation and seq_len")
        card.goals.append(Goal("bonus", GOAL_VS, NOT_RUN, missing))

    if fsdp:
        import pandas as pd

        rows = []
        for run in fsdp:
            r = row(run, "FSDP")
            a, fs = run.as_built, run.spec.fsdp
            r["run"] = ("full shard" if fs.reshard_after_forward else "no reshard (grad-op)") + \
                (" + CPU offload" if fs.cpu_offload else "") + \
                (" via Accelerate" if fs.via == "accelerate" else "")
            r["mixed precision"] = a.get("mixed_precision")
            rows.append(r)
            if a.get("cpu_offload_note"):
                card.notes.append(f"{run.experiment}: {a['cpu_offload_note']}.")
        card.tables.append(Table("FSDP variants", pd.DataFrame(rows),
                                 "same measurements as above; all FSDP runs of this stage"))
        card.tables.append(phase_peak_table(fsdp, "Per-rank peak memory: load, training and save phases"))
        card.figures.append(Figure("Loss curves", loss_curves(fsdp, "Stage 4 loss"),
                                   "mean training loss over data-parallel ranks per optimizer step"))
        parity = parity_rows(fsdp, runs, "FSDP run")
        if parity:
            card.tables.append(Table("Loss vs DDP (same seed, data, global batch, recipe)", pd.DataFrame(parity),
                                     "max absolute difference of the mean training loss per optimizer step"))
            card.notes.append(gap_sentence(parity, "FSDP run", "FSDP sharding", "FSDP"))
        else:
            card.notes.append(NOT_COMPARED.format(what="FSDP"))
    unmeasured = [r for r in fsdp if r.timing.comm_inflight_s_per_step.median is None]
    if unmeasured:
        card.notes.append(f"Communication time was not measured for {len(unmeasured)} of {len(fsdp)} FSDP run(s) "
                          f"({unmeasured[0].experiment}: \"{unmeasured[0].timing.get('comm_how', '')}\"); "
                          "their step times include it.")
    card.notes.append(eval_sentence([r for r in runs if r.stage == "fsdp"]))  # base vs tuned eval loss
    return card


def _pair_axes():
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig, axes

