"""The checkpoint section of the report: one row per trained experiment from its
validation.json (distlab/jobs/validate.py): reload diff, resharding, resume parity, export,
size and save/load seconds. Not a stage card: build.py places it after the stage cards.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from distlab.report.cards import FAILED, NOT_RUN, PASSED, Card, Goal, Table
from distlab.report.report_run import ReportRun

TITLE = "Checkpoints users can trust"


def validation_of(run: ReportRun) -> Mapping | None:
    """The run's validation.json (read by collect.load_run, a declared input), or None when
    validation has not run."""
    return run.validation


UNREADABLE = "unreadable"  # a passed check without the figures distlab writes (a foreign file)


def _cell(check: dict | None, passed_text, unreadable: list) -> str:
    """'not run', the check's status, or (when it passed) the measured value; 'unreadable', with
    what is missing appended to `unreadable`, when a passed check lacks its figures."""
    if not check:
        return "not run"
    if check["status"] != PASSED:
        return check["status"]
    try:
        return passed_text(check)
    except (KeyError, TypeError, ValueError) as exc:
        unreadable.append(f"{type(exc).__name__}: {exc}")
        return UNREADABLE


def export_cell(check: dict) -> str:
    """What the export is (diffusers LoRA file, PEFT adapter folder, HF folder) and its logit gap."""
    if "max_abs_output_diff" in check:
        return "diffusers LoRA"
    kind = "HF" if "layout" in check else "PEFT adapter"
    gap = f" ({check['max_abs_logit_diff']:.1e})" if "max_abs_logit_diff" in check else ""
    return kind + gap + (" + merged" if "merged_max_abs_logit_diff" in check else "")


def row(run: ReportRun, validation: dict, unreadable: list | None = None) -> dict:
    """The run's table row; what a passed check lacks (a validation.json of another shape) goes
    to `unreadable`, its cell reading 'unreadable'."""
    unreadable = [] if unreadable is None else unreadable
    checks = validation.get("checks", {})
    sizes = checks.get("size_and_time") or {}
    return {
        "machine": run.machine, "experiment": run.experiment, "strategy": run.spec.strategy,
        "validated": validation.get("status"),
        "reload max |dlogit|": _cell(checks.get("reload"), lambda c: f"{c['max_abs_logit_diff']:.1e}", unreadable),
        "reshard": _cell(checks.get("reshard"), lambda c: f"{c['from_world_size']}->{c['to_world_size']} ranks "
                                                          f"({c['max_abs_logit_diff']:.1e})", unreadable),
        "resume max |dloss|": _cell(checks.get("resume_parity"),
                                    lambda c: f"{c['max_abs_loss_diff']:.1e} ({c['steps_resumed']} steps)",
                                    unreadable),
        "export": _cell(checks.get("export"), export_cell, unreadable),
        "size (MB)": round(sizes["checkpoint_bytes"] / 1e6, 2) if sizes.get("checkpoint_bytes") else None,
        "save (s)": round(sizes["save_seconds"], 3) if sizes.get("save_seconds") is not None else None,
        "load (s)": round(sizes["load_seconds"], 3) if sizes.get("load_seconds") is not None else None,
    }


CHECK_NAMES = {"reload": "reload", "reshard": "reshard", "resume_parity": "resume", "export": "export"}


def goal_title(pairs) -> tuple[str, str]:
    """(title naming only the checks every validated checkpoint passed, sentences naming the
    others): a checkpoint whose resharding was unsupported must not be called resharded."""
    passed_by_all, caveats = [], []
    for key, name in CHECK_NAMES.items():
        statuses = [((v.get("checks") or {}).get(key) or {}).get("status", NOT_RUN) for _, v in pairs]
        if all(s == PASSED for s in statuses):
            passed_by_all.append(name)
            continue
        others = [f"{r.experiment} {s}" for (r, _), s in zip(pairs, statuses) if s != PASSED]
        caveats.append(f"{name}: {', '.join(others)}")
    checked = ", ".join(passed_by_all) or "no check"
    title = f"Every validated checkpoint passed {checked}"
    return title, (". Not passed by every checkpoint: " + "; ".join(caveats) if caveats else "")


def unsaved(runs: list[ReportRun]) -> list[ReportRun]:
    """Runs that trained (their figures stand) but whose final save failed."""
    return [r for r in runs if (r.section("checkpoint") or {}).get("status") == "failed"]


def checkpoint_card(runs: list[ReportRun]) -> Card | None:
    """The checkpoint table and its goal; None when no run has a validation.json or a failed save."""
    import pandas as pd

    pairs = [(r, validation_of(r)) for r in runs if r.status == "ok"]
    pairs = [(r, v) for r, v in pairs if v is not None]
    failed_saves = unsaved(runs)
    if not pairs and not failed_saves:
        return None
    card = Card(90, TITLE)
    if failed_saves:
        card.goals.append(Goal("minimal", "Every trained run saved its checkpoint", FAILED,
                               "trained but not saved (their figures stand; metrics.json has the error): "
                               + "; ".join(f"{r.experiment} ({r.status}): "
                                           f"{r.section('checkpoint').get('error', 'no error recorded')[:300]}"
                                           for r in failed_saves),
                               [os.path.join(r.folder, "metrics.json") for r in failed_saves]))
    if not pairs:
        return card
    rows, foreign = [], {}
    for run, validation in pairs:
        unreadable: list = []
        rows.append(row(run, validation, unreadable))
        if unreadable:  # a foreign file: its "passed" is not taken on trust
            foreign[run.experiment] = (f"{os.path.join(run.folder, 'validation.json')} is not a validation.json "
                                          f"distlab wrote, a passed check lacks its figures ({'; '.join(unreadable)})")
    if foreign:
        card.notes.append(f"Shown '{UNREADABLE}': " + "; ".join(foreign.values()) + ".")
    failed = [r.experiment for r, v in pairs if not v.get("passed") or r.experiment in foreign]
    links = [os.path.join(r.folder, "validation.json") for r, _ in pairs]
    title, caveats = goal_title(pairs)
    if failed:
        reasons = "; ".join(f"{r.experiment}: {foreign.get(r.experiment) or v.get('reason', v.get('status'))}"
                            for r, v in pairs if r.experiment in failed)
        card.goals.append(Goal("minimal", f"Every validated checkpoint passed {', '.join(CHECK_NAMES.values())}",
                               FAILED,
                               f"{len(pairs) - len(failed)} of {len(pairs)} validated; {reasons}" + caveats, links))
    else:
        card.goals.append(Goal("minimal", title, PASSED,
                               f"all {len(pairs)} checkpoints passed the checks named in this goal within tolerance"
                               + caveats, links))
    unvalidated = [r.experiment for r in runs if r.status == "ok" and validation_of(r) is None]
    if unvalidated:
        card.notes.append(f"Not validated ({NOT_RUN}; config validation.scope, default per_format: the first "
                          f"experiment of each distinct checkpoint format): {', '.join(unvalidated)}.")
    from distlab.records.validation import MERGE_TOLERANCE, PARITY_TOLERANCE, RELOAD_TOLERANCE

    tolerances = {"reload, reshard and export logits": RELOAD_TOLERANCE, "merged LoRA export": MERGE_TOLERANCE,
                  **{f"resume loss ({p})": t for p, t in PARITY_TOLERANCE.items()}}
    how = ("Each experiment's checkpoint validated in its own Snakemake job by processes that did not train: "
           "reload = max |logit diff| of the reloaded state (gathered one layer at a time, run on the CPU in fp32) "
           "on a fixed eval batch vs the logits recorded at save time; reshard = the final checkpoint loaded at "
           "another world size; resume = max |loss diff| of "
           "training resumed from the mid-run checkpoint vs the uninterrupted run's own steps; export = "
           "the export's own files (LoRA: the PEFT adapter folder on the base) run the same way, its files laid out "
           "as save_pretrained writes them (text-to-image: the UNet's output on fixed held-out inputs stands for the "
           "logits, and a plain StableDiffusionPipeline loads the LoRA with load_lora_weights and generates); "
           "size = bytes on disk; save and "
           "load = strategy.save_checkpoint / load_checkpoint wall seconds. Max abs tolerances: "
           + ", ".join(f"{k} {v:g}" for k, v in tolerances.items()) + " (each validation.json states the one it "
           "used). 'unsupported' = the format cannot do it, with the reason in validation.json.")
    card.tables.append(Table("Checkpoint validation", pd.DataFrame(rows), how))
    return card
