"""Independent launches of one experiment (spec `launches`): run-to-run variance measured.

The first launch is the experiment (it trains, evaluates, saves). Each further launch runs
the same job again in fresh processes with a fresh process group, timing its steps only (no
checkpoint, no held-out eval), in a folder of its own that is removed afterwards. What each
launch measured (its throughput in the task's unit: tokens/s, images/s; median step, last loss, machine
noise) is folded into the first
launch's metrics.json under `launches`; the report's throughput is then their median and its
spread their min-max (distlab.report.collect.throughput_stats). A launch that reached other
losses did not do the same work: the run fails.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from distlab.records.job import Job, replace
from distlab.records.run_layout import run_files_dir
from distlab.records.run_outputs import RunRecord, read_run_record, write_metrics
from distlab.records.spec import thaw

# Float summation order only (the same seed, data and world size): identical here to ~1e-6.
LOSS_TOLERANCE = 1e-5


def summary_of(record: RunRecord) -> dict:
    """What one launch measured, its throughput in the unit the run counts (its task's: tokens/s,
    images/s), named as the run's throughput names it."""
    return {"unit": record.unit, f"{record.unit}s_per_s": record.units_per_s,
            "median_step_s": record.timing.step_time_s.median, "loss_last": record.loss.last,
            "noise": thaw(record.noise)}


def repeat_launches(job: Job, run_launcher, log_path: str | None, timeout: float | None) -> list[dict]:
    run_dir = Path(job.run_dir)
    first = read_run_record(run_dir / "metrics.json")
    launches = [summary_of(first)]
    for k in range(2, job.spec.launches + 1):
        folder = run_dir / f"launch-{k}"
        shutil.rmtree(folder, ignore_errors=True)
        again = replace(job, run_dir=str(folder), checkpoint_dir=None, timing_only=True, base_eval_json=None)
        run_files_dir(folder).mkdir(parents=True)
        job_path = folder / "job.json"
        again.write(job_path)
        run_launcher(again, str(job_path.resolve()), log_path, timeout)
        again_record = read_run_record(folder / "metrics.json")
        gap = max(abs(a - b) for a, b in zip(first.loss.per_step, again_record.loss.per_step))
        if gap > LOSS_TOLERANCE:
            raise RuntimeError(f"launch {k} of {job.spec.id} reached other losses (max gap {gap:.2e} > "
                               f"{LOSS_TOLERANCE}): not the same work as launch 1")
        launches.append(summary_of(again_record))
        shutil.rmtree(folder)
    write_metrics(run_dir, first.updated(launches=launches))
    return launches
