"""Run one experiment: write its job file, hold its GPUs, start its ranks with the launcher
its spec names (distlab.launchers), and turn what they left into a status.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from distlab.records.job import Job, replace
from distlab.launchers import get_launcher
from distlab.launchers.process import refuse_if_running
from distlab.records.run_layout import run_files_dir
from distlab.records.sharing import portable
from distlab.records.spec import Spec


def job_file(run_dir: str) -> str:
    """The job file's absolute path: every process of the launch names it on its command
    line, which is how leftovers of an earlier launch are found (distlab.launchers.process)."""
    return str((Path(run_dir) / "job.json").resolve())


def _minutes(runtime) -> float | None:
    """Snakemake's runtime resource (minutes); None where the rule has none it can give."""
    return float(runtime) if isinstance(runtime, (int, float)) and runtime > 0 else None


def rule_job(snakemake, run_dir: str) -> Job:
    """The job of a training rule (train, two_hosts) from its Snakemake object."""
    spec = Spec.checked(snakemake.params.spec, f"experiment {snakemake.params.spec.get('id')!r}")
    inputs = dict(snakemake.input.items())
    return Job(
        spec=spec,
        # The step-time prediction's measured parts (absolute: Ray workers run elsewhere).
        probe_json=os.path.abspath(inputs["probe"]) if inputs.get("probe") else None,
        collectives_json=os.path.abspath(inputs["collectives"]) if inputs.get("collectives") else None,
        run_dir=run_dir,
        data_dir=snakemake.input.data,
        model_source=snakemake.params.model_source,
        hardware_json=snakemake.input.hardware,
        env_allowlist=list(snakemake.params.env_allowlist),
        checkpoint_dir=snakemake.output.checkpoint,
        # The base model's eval loss, set beside the run's (absolute: Ray workers run elsewhere).
        base_eval_json=os.path.abspath(snakemake.input.base_eval),
        # Trackers' store beside the machine's runs (absolute, as above): results/<machine>/tracking.
        tracking_dir=os.path.abspath(os.path.join(os.path.dirname(run_dir), "tracking")),
        # The bound on every collective wait of its ranks (distlab.records.job.collective_timeout).
        runtime_minutes=_minutes(getattr(snakemake.resources, "runtime", None)),
    )


def write_job(job: Job) -> str:
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    return job.write(job_file(job.run_dir))


def write_oom_metrics(job: Job) -> bool:
    """Fold the ranks' oom-rank<N>.json into a metrics.json with status 'oom' (then removed:
    metrics.json, a declared output, holds them). A run that ran out of memory in its final
    save had already written its figures (distlab.rank.worker): they are kept, its checkpoint
    recorded as failed."""
    from distlab.records.metrics import METRICS_SCHEMA_VERSION, library_versions
    from distlab.records.run_outputs import read_run_record, write_metrics

    run_dir = Path(job.run_dir)
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("oom-rank*.json"))]
    if not records:
        return False
    hardware = json.loads(Path(job.hardware_json).read_text())
    spec = job.spec
    metrics = {"schema_version": METRICS_SCHEMA_VERSION, "experiment": spec.id, "stage": spec.stage,
               "machine": hardware["machine"], "status": "oom", "spec": spec, "oom": records,
               "memory_budget_gib": spec.memory_budget_gib, "versions": library_versions()}
    written = run_dir / "metrics.json"
    if written.is_file():  # this launch's figures, written before its final save (launch removed older ones)
        metrics = read_run_record(written).updated(
            **metrics, oom_phase="final save",
            checkpoint={"status": "failed", "error": "out of memory during the final save: "
                        + "; ".join(f"rank {r['rank']}: {r['error']}" for r in records)})
    else:
        (run_dir / "steps.jsonl").write_text("")
    write_metrics(run_dir, metrics)
    for path in run_dir.glob("oom-rank*.json"):
        path.unlink()
    return True


@contextlib.contextmanager
def assigned_gpus(spec, run_dir: str | None = None, lock_dir: str | None = None):
    """CUDA runs hold their own disjoint GPUs (distlab.jobs.gpu_alloc) while the ranks run; every
    launcher's rank environment inherits CUDA_VISIBLE_DEVICES, and devices.json records it in
    run_dir. Training (run_dir), validation (both) and the collective benchmark (lock_dir, no run
    folder) hold them here; without lock_dir the locks sit beside run_dir's machine folder."""
    # On an existing Ray cluster, Ray places the ranks and assigns their GPUs.
    if spec.device != "cuda" or (spec.launcher == "ray" and spec.ray.address):
        yield None
        return
    from distlab.jobs.gpu_alloc import allocate, lock_dir_for

    # run_dir is <results>/<machine>/<experiment>
    lock_dir = lock_dir or lock_dir_for(Path(run_dir).resolve().parent.parent)
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    with allocate(spec.world_size, lock_dir) as ids:
        if run_dir:  # a run's record (the collective benchmark has no run folder)
            Path(run_dir, "devices.json").write_text(json.dumps(
                {"cuda_visible_devices": ids, "inherited": previous, "lock_dir": portable(lock_dir),
                 "how": "exclusive fcntl locks, one per GPU, held while the ranks ran (distlab.jobs.gpu_alloc)"}))
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        try:
            yield ids
        finally:
            if previous is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = previous


def launch(job: Job, log_path: str | None = None, timeout: float | None = None) -> str:
    """Run the experiment; returns its status ('ok' or 'oom'). Any other failure raises."""
    if job.spec.steps is None:  # epochs: the prepared data's train blocks decide, before any rank starts
        from distlab.configuration.finetune_config import resolve_epochs

        job = replace(job, spec=resolve_epochs(job.spec, job.data_dir))
    run_launcher = get_launcher(job.spec.launcher)
    refuse_if_running(job_file(job.run_dir), f"experiment {job.spec.id}")
    job_path = write_job(job)
    for stale in [*Path(job.run_dir).glob("oom-rank*.json"), Path(job.run_dir) / "metrics.json"]:
        stale.unlink(missing_ok=True)  # only this launch's records may be read back below
    files = run_files_dir(job.run_dir)  # a declared output: present, and only this run's files
    shutil.rmtree(files, ignore_errors=True)
    files.mkdir()
    try:
        with assigned_gpus(job.spec, job.run_dir) as gpus:
            if gpus is None:  # devices.json is a declared output of every run
                Path(job.run_dir, "devices.json").write_text(json.dumps(
                    {"cuda_visible_devices": [], "how": "no GPU of this machine held: a CPU run, or Ray "
                     "assigned the devices on its cluster (metrics.json ray block)"}))
            run_launcher(job, job_path, log_path, timeout)
            if job.spec.launches > 1 and (Path(job.run_dir) / "metrics.json").is_file():
                from distlab.jobs.launches import repeat_launches

                repeat_launches(job, run_launcher, log_path, timeout)  # the GPUs held for these too
    except RuntimeError:
        if write_oom_metrics(job):
            return "oom"
        raise
    finally:  # read by the ranks while they ran; kept, as shared results, without this checkout's paths
        Path(job_path).write_text(json.dumps(portable(job.to_dict()), indent=1))
    metrics = Path(job.run_dir) / "metrics.json"
    if not metrics.is_file():
        raise RuntimeError(f"the ranks exited cleanly but wrote no {metrics}")
    return "ok"
