"""Checkpoint validation: one job per trained experiment, in processes that did not train.

The driver (validate_run, the Snakemake rule's script) checks the manifest, then starts the
ranks of distlab/rank/validate_ranks.py under the experiment's launcher for two phases:
  "same"    at the saved world size: export (rank 0, first thing it loads), reload, LoRA
            base weights, resume parity from the mid-run checkpoint;
  "reshard" at the other world size (2 -> 1, 1 -> 2): load the final checkpoint there;
and writes results/<machine>/<experiment>/validation.json:
  {"schema_version": 1, "experiment": id, "passed": bool, "status": ..., "checks": {name: {"status":
   "passed"|"failed"|"unsupported", ...details, the tolerance used}}}
"""
from __future__ import annotations

import json
from pathlib import Path

from distlab.records.spec import Spec
from distlab.configuration.training_tools import adapts
from distlab.records.job import ValidationJob, replace
from distlab.records.validation import (FAILED, MERGE_TOLERANCE, PARITY_TOLERANCE, PASSED,  # noqa: F401 (theirs too)
                                       RELOAD_TOLERANCE, UNSUPPORTED, VALIDATION_SCHEMA_VERSION)

def phase_checks(phase: str, spec: Spec) -> list[str]:
    """The checks a phase records (export runs once, on rank 0, before any phase)."""
    if phase == "reshard":
        return ["reshard"]
    return ["compatibility", "reload", "resume_parity"] + (["lora_base_frozen"] if adapts(spec) else [])


def broken_checks(checks: dict, names: list[str]) -> dict:
    """{check: reason} of those that raised an unexpected exception or were never reached."""
    compat = checks.get("compatibility", {})
    if compat.get("status") == FAILED and not compat.get("exception"):
        return {}  # a refused checkpoint stops the phase by design
    return {n: checks.get(n, {}).get("reason", "not reached") for n in names
            if n not in checks or checks[n].get("exception")}


def required_checks(spec: Spec) -> list[str]:
    names = ["manifest", "compatibility", "reload", "resume_parity", "export"]
    return names + (["lora_base_frozen"] if adapts(spec) else [])


def verdict(result: dict, spec: Spec) -> dict:
    """passed: every required check passed and no check failed (resharding may be unsupported)."""
    checks = result["checks"]
    failed = [n for n, c in checks.items() if c["status"] == FAILED]
    missing = [n for n in required_checks(spec) if checks.get(n, {}).get("status") != PASSED]
    result["passed"] = not failed and not missing
    result["status"] = PASSED if result["passed"] else FAILED
    if not result["passed"]:
        result["reason"] = "; ".join([f"{n} failed" for n in failed] +
                                     [f"{n} {checks[n]['status'] if n in checks else 'not run'}"
                                      for n in missing if n not in failed])
    return result


# -- the driver -----------------------------------------------------------------------------------
def validate_run(run_dir, model_source: str, data_dir: str, out_path, log_path=None, timeout: float = 600) -> dict:
    from distlab.records.checkpoint_files import step_folders, verify_manifest

    from distlab.records.run_outputs import read_run_record

    run_dir = Path(run_dir)
    record = read_run_record(run_dir / "metrics.json")
    spec = record.spec
    result = {"schema_version": VALIDATION_SCHEMA_VERSION, "experiment": spec.id, "passed": False,
              "status": None, "checks": {}}
    root = run_dir / "checkpoint"
    if record.status != "ok":
        result.update(status="nothing to validate",
                      reason=f"the run ended with status {record.status!r}; it saved no checkpoint")
        return _write(out_path, result)
    failed_save = root / "FAILED.json"  # distlab.rank.training_checkpoints.FAILED
    if failed_save.is_file():
        why = json.loads(failed_save.read_text())["error"]
        result.update(status="nothing to validate", reason=f"the run trained but its final save failed: {why}")
        return _write(out_path, result)
    if (root / "UNSUPPORTED.json").is_file():
        why = json.loads((root / "UNSUPPORTED.json").read_text())["reason"]
        result["checks"] = {n: {"status": UNSUPPORTED, "reason": f"no checkpoint: {why}"}
                            for n in required_checks(spec)}
        return _write(out_path, verdict(result, spec))
    final = root / "final"
    parity = step_folders(root)
    problems = [p for folder in [final, *parity] for p in verify_manifest(folder)]
    result["checks"]["manifest"] = {
        "status": FAILED if problems else PASSED, "problems": problems,
        "checked": [str(f) for f in [final, *parity]],
        "how": "every file's size and sha256 against MANIFEST.json, and no unlisted file"}
    if problems:
        for name in required_checks(spec)[1:]:
            result["checks"][name] = {"status": FAILED, "reason": "not attempted: the manifest check failed"}
        return _write(out_path, verdict(result, spec))

    work = run_dir / "validation-work"
    work.mkdir(exist_ok=True)
    job = ValidationJob(spec=spec, run_dir=str(run_dir), model_source=model_source, data_dir=data_dir,
                        final=str(final), parity=str(parity[-1]) if parity else None,
                        expected_losses=record.loss.per_step,
                        expected_lrs=(record.optimization or {}).get("lr_per_step"))
    other, why_not = reshard_target(spec)
    plans = launch_plans(spec, other if why_not is None else None)
    for index, plan in enumerate(plans):
        result["checks"].update(_run_phase(replace(job, plan=plan), work / f"launch{index}", log_path, timeout))
        for name, world in plan[1:]:
            # A library may not survive its process changing groups (DeepSpeed caches the first
            # one): a phase that broke in the reused process gets a fresh launch of its own.
            broken = broken_checks(result["checks"], phase_checks(name, spec))
            if broken:
                retry = _run_phase(replace(job, plan=[[name, world]]), work / f"launch{index}-{name}", log_path,
                                   timeout)
                for n in phase_checks(name, spec):
                    if n in retry:
                        result["checks"][n] = dict(retry[n], first_attempt_in_reused_process=broken.get(n))
    if why_not is not None:
        result["checks"]["reshard"] = {"status": UNSUPPORTED, "to_world_size": other, "reason": why_not}
    for name in required_checks(spec) + ["reshard"]:
        if name not in result["checks"]:
            result["checks"][name] = {"status": FAILED, "reason": "not reached: the validation ranks exited early "
                                      f"(see {log_path or 'the log'})"}
    result["checks"]["size_and_time"] = _size_and_time(final, result["checks"]["reload"])
    return _write(out_path, verdict(result, spec))


def reshard_target(spec: Spec) -> tuple[int, str | None]:
    """The other world size (2 -> 1, 1 -> 2) and why it cannot run here, if it cannot."""
    other = 1 if spec.world_size > 1 else 2
    if spec.device == "cuda":
        import torch

        if torch.cuda.device_count() < other:
            return other, f"needs {other} GPUs, this machine has {torch.cuda.device_count()}"
    return other, None


def launch_plans(spec: Spec, other: int | None) -> list[list[list]]:
    """[[phase, world size], ...] per launch. A process start costs seconds of imports, so one
    launch serves both world sizes: the larger world runs first, then rank 0 goes on alone in a
    one-rank group. Accelerate's launcher fixes the process count from its config file, so it
    gets one launch per world size."""
    phases = [["same", spec.world_size]] + ([["reshard", other]] if other else [])
    if spec.launcher == "accelerate":
        return [[phase] for phase in phases]
    return [sorted(phases, key=lambda p: -p[1])]


def _size_and_time(final: Path, reload: dict) -> dict:
    from distlab.records.checkpoint_files import dir_bytes, read_meta

    meta = read_meta(final)
    state = final / "state"
    return {"status": PASSED if reload.get("load_seconds") is not None else UNSUPPORTED,
            "state_bytes": dir_bytes(state), "checkpoint_bytes": dir_bytes(final),
            "export_bytes": dir_bytes(final / "export") if (final / "export").is_dir() else None,
            "save_seconds": meta["save"]["save_seconds"], "export_seconds": meta["save"].get("export_seconds"),
            "load_seconds": reload.get("load_seconds"),
            "how": "bytes: sum of file sizes; save: strategy.save_checkpoint wall time at the end of training; "
                   "load: strategy.load_checkpoint wall time in the validation ranks (rank 0, to a barrier)"}


def _write(path, result: dict) -> dict:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
    return result


def _run_phase(job: ValidationJob, folder: Path, log_path, timeout) -> dict:
    """Start one launch's ranks; returns the checks rank 0 recorded (partial if they died)."""
    from distlab.jobs.gpu_alloc import lock_dir_for
    from distlab.jobs.launch import assigned_gpus
    from distlab.launchers.ranks import start_ranks
    from distlab.records.sharing import portable

    folder.mkdir(exist_ok=True)
    out = folder / "checks.json"
    out.unlink(missing_ok=True)
    job_path = (folder / "job.json").resolve()  # absolute: the ranks are found by it (launchers.process)
    spec = job.spec.replace(world_size=job.plan[0][1])
    # The ranks' run_dir is this launch's folder: what strategies and launchers write there
    # (accelerate config, devices.json) must not overwrite the training run's files.
    replace(job, out=str(out), run_dir=str(folder)).write(job_path)
    # The GPUs are held for this launch only, from the same lock folder training used.
    locks = lock_dir_for(Path(job.run_dir).resolve().parent.parent)
    with assigned_gpus(spec, str(folder), locks):
        try:  # under the launcher the experiment trained with (distlab.launchers.ranks.rank_command)
            start_ranks(spec, "distlab.rank.validate_ranks", ["--job", str(job_path)], job_path, log_path, timeout,
                        run_dir=folder, what="validation ranks", check=False)  # what they recorded decides
        finally:  # kept beside the run's results: without this checkout's paths (distlab.records.sharing)
            job_path.write_text(json.dumps(portable(json.loads(job_path.read_text()))))
    return json.loads(out.read_text()) if out.is_file() else {}
