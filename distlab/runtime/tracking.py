"""Experiment trackers on rank 0, through the libraries themselves, offline by default:

    <run>/run_files/tensorboard/        this run's event files (torch.utils.tensorboard.SummaryWriter;
                                        the spec as TensorBoard hparams), a declared output that
                                        travels with the run: `tensorboard --logdir results`
    <results>/<machine>/tracking/mlflow.db
                                        one local sqlite MLflow store for the machine's runs (MLflow
                                        3.x refuses a bare ./mlruns file store):
                                        `mlflow ui --backend-store-uri sqlite:///<that file>`

What the store and the event files hold travels with results/<machine>/ (distlab.records.sharing): no
path of this checkout, working folder or home folder (the spec's paths written relative, as in
metrics.json), no user or host name (mlflow.user and mlflow.source.name are set to "distlab").
MLflow writes any local artifact location as an absolute path, so the store's locations are
`mlflow-artifacts:/...` URIs instead: the ones `mlflow server`/`mlflow ui` writes itself, resolved
by whichever server opens the store (its --artifacts-destination); distlab logs no artifacts.

One MLflow experiment per machine (distlab/<machine>), one MLflow run per launch of an
experiment (run name = experiment id; the spec as its parameters), written with MlflowClient's
log_batch: one transaction per flush. The store is shared by every job of the machine, like
its logs, so no single rule declares it (`snakemake --delete-all-output` leaves it); its
creation, the experiment lookup and the run's creation happen under a file lock. A relaunch
(resume) logs the steps it restored first, so its run holds the whole curve. (Accelerate's
tracker classes need an Accelerate state in every rank, which DDP, DeepSpeed and FSDP ranks
do not make.)
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import socket
import sys
import time
from pathlib import Path

from distlab.records.spec import Spec
from distlab.records.job import Job

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "images_per_s", "memory_bytes", "step_time_s")
# Where the store's experiments keep artifacts: MLflow's server-resolved scheme (see above).
ARTIFACTS = "mlflow-artifacts:/"
# The run's user and source in MLflow's own tags: what ran it, not who or from where.
ANONYMOUS_TAGS = {"mlflow.user": "distlab", "mlflow.source.name": "distlab"}


def tracking_dir(job: Job) -> Path:
    """<results>/<machine>/tracking, the MLflow store's folder (the job may name another,
    absolute: Ray workers run elsewhere)."""
    return Path(job.tracking_dir or Path(job.run_dir).resolve().parent / "tracking")


def flat_params(spec: Spec, prefix: str = "") -> dict:
    """The resolved spec as tracker parameters: nested keys joined with '.', values as
    bool/int/float/str (None and lists as their JSON text)."""
    out = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, f"{name}."))
        elif value is None or isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def hide_mlflow(uses_it: bool) -> bool:
    """Keep MLflow out of a process that writes nothing to it (a rank other than 0, a run without
    the mlflow tracker, a validation rank). DeepSpeed's import pulls it in otherwise: its
    autotuner, which distlab never starts, does `try: import mlflow` at import time (~0.55 s of
    CPU per DeepSpeed process here, benchmarks/harness_overhead.py). None in sys.modules is
    Python's own mark for "not importable": that optional import fails and DeepSpeed goes on
    without it. True if hidden; an MLflow already imported is left alone."""
    if uses_it or "mlflow" in sys.modules:
        return False
    sys.modules["mlflow"] = None
    return True


@contextlib.contextmanager
def _store_lock(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "mlflow.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def mlflow_uri(root: Path) -> str:
    return f"sqlite:///{(root / 'mlflow.db').resolve()}"


def create_store(root: Path) -> None:
    """Make the machine's store with `mlflow-artifacts:/` as its default artifact root (under
    the store lock): a store MlflowClient creates records ./mlruns of the working folder, as an
    absolute path, for its Default experiment."""
    if (root / "mlflow.db").exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(mlflow_uri(root), ARTIFACTS)._dispose_engine()


class Trackers:
    """The trackers a spec's `tracking` names, started on rank 0 (the caller's duty)."""

    def __init__(self, job: Job, start_step: int):
        spec = job.spec
        self.root = tracking_dir(job)
        self.machine = Path(job.run_dir).resolve().parent.name
        self.writer = self.client = self.run_id = None
        self.where = {}
        from distlab.records.sharing import portable

        params = flat_params(portable(spec))  # what it says in metrics.json: no local absolute path
        if "tensorboard" in spec.tracking:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            from distlab.records.run_layout import run_files_dir

            logdir = run_files_dir(job.run_dir).resolve() / "tensorboard"
            self.writer = SummaryWriter(str(logdir))
            for summary in hparams(params, {}):  # the spec in TensorBoard's HPARAMS tab
                self.writer.file_writer.add_summary(summary)
            self.where["tensorboard"] = str(logdir)
        if "mlflow" in spec.tracking:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient

            name = f"distlab/{self.machine}"
            with _store_lock(self.root):
                create_store(self.root)
                self.client = MlflowClient(tracking_uri=mlflow_uri(self.root))
                found = self.client.get_experiment_by_name(name)
                experiment = found.experiment_id if found else self.client.create_experiment(
                    name, artifact_location=f"{ARTIFACTS}{name}")
                self._close_stale_runs(experiment, spec.id)
                self.run_id = self.client.create_run(experiment, run_name=spec.id, tags={
                    **ANONYMOUS_TAGS, "distlab.experiment": spec.id, "distlab.machine": self.machine,
                    "distlab.resumed_from_step": str(start_step)}).info.run_id
            items = [Param(k, str(v)) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])
            self.where["mlflow"] = {"tracking_uri": mlflow_uri(self.root), "experiment": name, "run_id": self.run_id}

    def _close_stale_runs(self, experiment: str, exp_id: str) -> None:
        """Runs of this experiment still RUNNING belong to a launch that died: say so."""
        for run in self.client.search_runs([experiment], f"tags.`distlab.experiment` = '{exp_id}' and "
                                                         "attributes.status = 'RUNNING'"):
            self.client.set_terminated(run.info.run_id, "KILLED")

    def log(self, rows: list[tuple[int, dict]]) -> None:
        """(step, {name: value}) rows; None and NaN values are left out."""
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = []
        for step, values in rows:
            for key, value in values.items():
                if isinstance(value, (int, float)) and value == value:
                    if self.writer is not None:
                        self.writer.add_scalar(key, value, global_step=step)
                    metrics.append(Metric(key, float(value), stamp, step))
        if self.writer is not None:
            self.writer.flush()
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            if self.client is not None:
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self) -> dict:
        if self.writer is not None:
            self.writer.close()
            # TensorBoard names its file events.out.tfevents.<time>.<host>.<pid>.<n>: the machine
            # tag in place of the host (distlab.records.sharing); TensorBoard reads any *tfevents* file.
            host = socket.gethostname()
            for path in Path(self.writer.log_dir).glob(f"events.out.tfevents.*.{host}.*"):
                path.rename(path.with_name(path.name.replace(f".{host}.", f".{self.machine}.", 1)))
        if self.client is not None:
            self.client.set_terminated(self.run_id, "FINISHED")
        return self.where


def step_values(row: dict) -> dict:
    """A step's tracker scalars (train/...) and eval point (eval/...) from its record."""
    out = {f"train/{k}": row.get(k) for k in SCALARS}
    if row.get("eval_loss") is not None:
        out["eval/loss"], out["eval/perplexity"] = row["eval_loss"], row["eval_perplexity"]
    return out
