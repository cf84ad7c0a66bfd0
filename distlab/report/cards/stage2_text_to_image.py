"""Stage 2's other half - LoRA fine-tuning of a Stable Diffusion model with Accelerate (the
text-to-image task, distlab/tasks/text_to_image): 1 vs 2 processes by the Accelerate config
file alone, images/s and memory per rank, the held-out denoising loss of the base model and
every run, and a sample grid (base vs tuned UNet, fixed prompts and seeds) as PNG.

It sees only text-to-image runs (TASK), whichever stage block they sit in. Every figure is
read from the runs' metrics.json, run_files/samples.png and validation.json.
"""
from __future__ import annotations

import base64
from pathlib import Path

from distlab.report.cards import FAILED, NOT_RUN, PASSED, SPREAD_CAVEAT, Card, Figure, Goal, Table, metrics_link
from distlab.report.cards.checkpoint_table import validation_of
from distlab.report.cards.stage2_accelerate import _accelerate_record, config_pairs, pair_links
from distlab.report.plots import loss_curves
from distlab.report.report_run import ReportRun

TASK = "text-to-image"
MIB = 2**20
GRIDS_SHOWN = 4  # sample grids embedded (one per run); the rest are linked from their run folders
TINY_SD_NOTE = ("The embedded default is a tiny Stable Diffusion with random weights (diffusers' test components, "
                "text_to_image.model.path null): its samples are noise before and after a few LoRA steps, so the "
                "grid shows the pipeline end to end (same prompts, seeds and scheduler; base UNet above, tuned "
                "below), not image quality. Point text_to_image.model.path at a Stable Diffusion 1.x/2.x folder "
                "to see a LoRA change the pictures.")


def images_per_s(run) -> tuple[float, float, float]:
    """(median, low, high) images/s from collect's spread (throughput.images_per_step over step times)."""
    stats = run.throughput_spread
    return stats.median, stats.low, stats.high


def heldout(run) -> tuple:
    ev = run.section("eval") or {}
    return (ev.get("base") or {}).get("loss"), (ev.get("trained") or {}).get("loss")


def memory_cell(run, phase: str) -> str:
    """Per-rank peaks in MiB: a phase's record (load_phase, training_phase), or a per-rank key
    (peak_through_save_bytes: eval, sampling, save and export included)."""
    peaks = [m.get(phase) if phase.endswith("_bytes") else (m.get(phase) or {}).get("rss_peak_bytes")
             for m in run.memory.per_rank]
    return " / ".join(f"{p / MIB:.0f}" if p else "-" for p in peaks)


def run_row(run) -> dict:
    median, low, high = images_per_s(run)
    base, tuned = heldout(run)
    flops = run.section("flops") or {}
    built = run.as_built
    return {"machine": run.machine, "experiment": run.experiment, "strategy": run.spec.strategy,
            "processes": built.world_size, "wrapped by": built.get("wrapped_by") or built.get("outer_wrapper"),
            "find_unused_parameters": built.get("find_unused_parameters", "-"),
            "images/s (spread)": f"{median:.1f} ({low:.1f}-{high:.1f})",
            "images/s per rank": round(median / built.world_size, 2),
            "median step (ms)": round(run.timing.step_time_s.median * 1000, 1),
            "loss first -> last": f"{run.loss.first:.4f} -> {run.loss.last:.4f}",
            "held-out base -> tuned": f"{base:.4f} -> {tuned:.4f}" if None not in (base, tuned) else "not measured",
            "GFLOPs/image": round(flops["flops_per_image"] / 1e9, 4) if flops.get("flops_per_image") else None,
            "MFU": f"{flops['mfu']:.2%}" if flops.get("mfu") is not None else "not computed",
            "load peak MiB/rank": memory_cell(run, "load_phase"),
            "training peak MiB/rank": memory_cell(run, "training_phase"),
            "peak through save MiB/rank": memory_cell(run, "peak_through_save_bytes")}


def scaling_goal(card: Card, accel: list[dict]) -> None:
    text = "Stable Diffusion LoRA with Accelerate, 1 vs 2 processes by the config file alone (images/s)"
    pairs = [(one, multi) for one, multi in config_pairs(accel) if multi.spec.world_size == 2]
    if not pairs:
        card.goals.append(Goal("minimal", text, NOT_RUN, "needs two text-to-image Accelerate runs whose specs differ "
                                                         "only in world_size (1 and 2)"))
        return
    one, multi = pairs[0]
    real = (one.as_built.world_size, multi.as_built.world_size)
    types = (_accelerate_record(one)["distributed_type"], _accelerate_record(multi)["distributed_type"])
    (m1, lo1, hi1), (m2, lo2, hi2) = images_per_s(one), images_per_s(multi)
    clear = lo2 > hi1 or lo1 > hi2
    card.goals.append(Goal(
        "minimal", text, PASSED if real == (1, 2) else FAILED,
        f"{one.experiment} and {multi.experiment}: same spec but world_size, real world sizes {real[0]} and "
        f"{real[1]} (Accelerate {types[0]}, {types[1]}); {m1:.1f} ({lo1:.1f}-{hi1:.1f}) vs {m2:.1f} ({lo2:.1f}-"
        f"{hi2:.1f}) images/s, {m2 / m1:.2f}x at {multi.spec.micro_batch} images per rank per micro-batch"
        f"{'' if clear else ' (spreads overlap: no clear winner)'}",
        pair_links(one, multi)))


def heldout_goal(card: Card, ok: list[dict]) -> None:
    text = "Held-out denoising loss of the base model and every run (same images, noise and timesteps)"
    if not ok:
        card.goals.append(Goal("minimal", text, NOT_RUN, "no successful text-to-image run"))
        return
    missing = [r.experiment for r in ok if None in heldout(r)]
    moved = "; ".join(f"{r.experiment} {heldout(r)[0]:.4f} -> {heldout(r)[1]:.4f}" for r in ok
                      if None not in heldout(r))
    how = (ok[0].section("eval") or {}).get("trained", {}).get("how", "")
    card.goals.append(Goal("minimal", text, FAILED if missing else PASSED,
                           (f"not measured for {', '.join(missing)}. " if missing else "")
                           + f"Fine-tuning moved held-out loss (base -> tuned): {moved}. {how}",
                           [metrics_link(r) for r in ok]))


def grid_goal(card: Card, ok: list[dict]) -> None:
    text = "Sample grid from fixed prompts and seeds, base vs tuned (PNG)"
    shown = []
    for run in ok:
        samples = ((run.section("eval") or {}).get("trained") or {}).get("samples") or {}
        png = Path(run.folder) / samples.get("path", "run_files/samples.png")
        if samples and run.samples_png:  # read by collect.load_run
            shown.append((run, samples, png))
    if not shown:
        card.goals.append(Goal("minimal", text, NOT_RUN if not ok else FAILED,
                               "no run wrote run_files/samples.png" if ok else "no successful text-to-image run"))
        return
    for run, samples, png in shown[:GRIDS_SHOWN]:
        card.figures.append(Figure(
            f"{run.machine}/{run.experiment}: base (top) vs tuned (bottom)",
            base64.b64encode(run.samples_png).decode(),
            f"prompts {samples['prompts']}, seeds {samples['seeds']}, {samples['steps']} steps of "
            f"{samples['scheduler']}, guidance {samples['guidance_scale']}, {samples['resolution']} px. "
            f"{samples['how']}"))
    card.goals.append(Goal("minimal", text, PASSED,
                           f"{len(shown)} run(s) sampled {len(shown[0][1]['prompts'])} prompt(s) x "
                           f"{len(shown[0][1]['seeds'])} seed(s) with the base and the tuned UNet"
                           + (f"; grids of {len(shown) - GRIDS_SHOWN} more in their run_files/" if
                              len(shown) > GRIDS_SHOWN else ""), [str(p) for _, _, p in shown]))


def export_goal(card: Card, ok: list[dict]) -> None:
    text = "The LoRA loads in a plain StableDiffusionPipeline (load_lora_weights) and reproduces the run's output"
    checked = [(r, ((validation_of(r) or {}).get("checks") or {}).get("export")) for r in ok]
    checked = [(r, c) for r, c in checked if c]
    if not checked:
        card.goals.append(Goal("bonus", text, NOT_RUN, "no text-to-image run's checkpoint was validated"))
        return
    bad = [r.experiment for r, c in checked if c["status"] != PASSED]
    card.goals.append(Goal("bonus", text, FAILED if bad else PASSED,
                           "; ".join(f"{r.experiment}: {c['status']}, max |output diff| "
                                     f"{c.get('max_abs_output_diff', float('nan')):.1e} (tolerance "
                                     f"{c.get('tolerance')})"
                                     for r, c in checked) + f". {checked[0][1].get('how', '')}",
                           [str(Path(r.folder) / "validation.json") for r, _ in checked]))


def count(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,}"


def advisor_tables(card: Card, runs: list[ReportRun]) -> None:
    """advice-sd.json (rule advise_sd; collect.attach_machine_records reads it) of each machine with
    text-to-image runs."""
    import pandas as pd

    from distlab.records.memory_phases import human

    for machine, advice in sorted({r.machine: r.sd_advice for r in runs}.items()):
        if not advice:
            continue
        plan = advice["devices"]
        rows = [{"model": m["model"], "denoiser": m["denoiser"], "parameters": count(m["denoiser_params"]),
                 "frozen (text encoders, VAE)": count(sum(m["frozen_params"].values())),
                 "LoRA r4": count(m["lora_params"]), "resolution": m["resolution"],
                 "activations (mb 1)": human(m["activation_bytes"]) if m["activation_bytes"] else m["activations_how"],
                 "DDP / device": human(m["ddp_bytes"]),
                 f"sharded over {m['devices']} / device": human(m["sharded_bytes"]),
                 "advice": m["recommendation"], "roadmap": m["roadmap"]} for m in advice["models"]]
        card.tables.append(Table(f"Advisor for text-to-image LoRA on {machine} ({plan['devices']} device(s), "
                                 f"{human(advice['usable_bytes_per_device'])} usable each: {plan['source']})",
                                 pd.DataFrame(rows), " ".join(advice["how"].split())))


def build(runs: list[ReportRun]) -> Card:
    import pandas as pd

    card = Card(2, "Stage 2 - Stable Diffusion LoRA with Accelerate (text-to-image)")
    ok = [r for r in runs if r.status == "ok" and r.throughput_spread]
    accel = [r for r in ok if r.spec.strategy == "accelerate" and _accelerate_record(r)]
    scaling_goal(card, accel)
    grid_goal(card, ok)
    heldout_goal(card, ok)
    export_goal(card, ok)
    if not ok:
        return card
    card.notes.append(TINY_SD_NOTE)
    task = ok[0].as_built.get("task") or {}
    frozen = task.get("frozen") or {}
    if frozen:
        card.notes.append("Frozen beside the trained UNet (never wrapped, sharded or partitioned; read from their "
                          "tensors): " + ", ".join(f"{name} {info['class']} {info['parameters']:,} parameters in "
                                                   f"{info['dtype']}, {info['zero3_partitioned']} ZeRO-3 partitions"
                                                   for name, info in frozen.items() if "parameters" in info) + ".")
    card.tables.append(Table("Text-to-image runs", pd.DataFrame([run_row(r) for r in ok]),
                             "images/s = images per optimizer step (all ranks) / median step time (max over ranks) "
                             "after warm-up; a step includes the frozen VAE encode and text encoder forward, as in "
                             "diffusers' example; GFLOPs/image and MFU count the UNet's forward+backward only "
                             "(FlopCounterMode, metrics.json flops.how); peaks = VmHWM per rank (load: process start "
                             "to the first step; training: the steps; through save: the whole process, held-out eval, "
                             f"sample grid, save and export included). The {SPREAD_CAVEAT}."))
    card.figures.append(Figure("Training loss (denoising MSE) per step", loss_curves(ok, "text-to-image runs"),
                               "mean over data-parallel ranks per optimizer step, warm-up included"))
    advisor_tables(card, runs)
    return card

