"""What one launch of an experiment's ranks is given: `Job` (training) and `ValidationJob`
(checkpoint validation), frozen and checked, written to and read from the job file.

Built at the door (the train rule's Snakemake object: `distlab.jobs.launch.rule_job`; the validation
driver; the test and benchmark harness) and read back by every rank through `read_job`, which
refuses a file with an unknown or missing field, naming the file. A launch that needs another
job (a further timing launch, a validation phase, a link's agents) makes it with
`dataclasses.replace`, never by editing the one it was given.
"""
from __future__ import annotations

import json
from datetime import timedelta
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from distlab.records.spec import FrozenDict, FrozenList, Spec, SpecError, freeze, thaw

__all__ = ["Job", "ValidationJob", "JobError", "read_job", "replace"]


class JobError(ValueError):
    """A job file that is not one distlab wrote (unknown or missing fields, a bad spec)."""


@dataclass(frozen=True)
class Job:
    """One training launch: the experiment's spec and where everything it reads and writes is."""
    spec: Spec
    # The run folder (metrics.json, steps.jsonl, job.json, run_files/).
    run_dir: str
    # The prepared data folder and the model (a built model's folder or the user's model.path).
    data_dir: str | None = None
    model_source: str | None = None
    # This machine's hardware.json (device peak, machine name); the base model's eval file.
    hardware_json: str | None = None
    base_eval_json: str | None = None
    # Environment variables allowed into the recorded environment (config env_allowlist).
    env_allowlist: FrozenList = field(default_factory=FrozenList)
    # Where checkpoints go (None: no checkpoint, e.g. further timing launches).
    checkpoint_dir: str | None = None
    # TensorBoard/MLflow store beside the machine's runs.
    tracking_dir: str | None = None
    # A further launch of the same experiment that only times steps (distlab.jobs.launches).
    timing_only: bool = False
    # A command prefix that runs the Ray driver inside a namespaced host (distlab.jobs.two_hosts), and
    # the names the two-host run gives its hosts' addresses in the Ray record.
    driver_inside: FrozenList = field(default_factory=FrozenList)
    host_names: FrozenDict | None = None
    # The Snakemake job's `runtime` resource (minutes): no collective of its ranks waits longer
    # (collective_timeout). None (a launch outside a rule): estimated_runtime_minutes.
    runtime_minutes: float | None = None
    # What rank 0 predicts the step time from before the first step (distlab.tools.step_time,
    # metrics.json `prediction`): the compute probe of the run's shapes and the collectives file
    # of its links; None where the rule gave none (no prediction, said so in the record).
    probe_json: str | None = None
    collectives_json: str | None = None

    def __post_init__(self):
        # The door: whatever was handed in is frozen from here on (lists stay lists: a FrozenList
        # compares equal to the list a rank computes).
        if not isinstance(self.spec, Spec):
            object.__setattr__(self, "spec", Spec(self.spec))
        for name in self._frozen_fields:
            value = getattr(self, name)
            object.__setattr__(self, name, freeze(list(value) if isinstance(value, tuple) else value))

    _frozen_fields = ("env_allowlist", "driver_inside", "host_names")

    def to_dict(self) -> dict:
        data = {f.name: thaw(getattr(self, f.name)) for f in fields(self)}
        data["kind"] = JOB_KINDS_BY_TYPE[type(self)]
        return data

    def write(self, path) -> str:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))
        return str(path)


@dataclass(frozen=True)
class ValidationJob(Job):
    """One validation launch: the run's job plus the checkpoint it checks and what it expects."""
    # The checkpoint folders: the final one and the newest periodic one (resume parity).
    final: str | None = None
    parity: str | None = None
    # The trained run's per-step losses and learning rates (resume parity compares against them).
    expected_losses: FrozenList = field(default_factory=FrozenList)
    expected_lrs: FrozenList | None = None
    # The phases this launch runs, [[name, world size]], and the file its raw checks go to.
    plan: FrozenList = field(default_factory=FrozenList)
    out: str | None = None

    _frozen_fields = Job._frozen_fields + ("expected_losses", "expected_lrs", "plan")


def estimated_runtime_minutes(spec, steps: int | None = None) -> int:
    """The runtime a train job is given when the config sets none: process start and data
    loading plus a generous second per step per repeat, per launch (`steps`: the spec's, or
    the epochs' resolved count)."""
    steps = steps if steps is not None else spec.steps
    steps = 3600 if steps is None else steps  # epochs not yet resolved: an hour of steps
    return (10 + (steps * spec.repeats) // 60) * spec.launches


def collective_timeout(job: Job | None, spec) -> timedelta:
    """How long a rank's collective may wait: the job's runtime, so that a rank left in a
    collective (its peer failed elsewhere) fails within its job's time rather than after
    gloo's and NCCL's default 30 minutes (10 for NCCL), whatever the job was allowed."""
    minutes = job.runtime_minutes if job is not None and job.runtime_minutes else estimated_runtime_minutes(spec)
    return timedelta(minutes=minutes)


JOB_TYPES = {"train": Job, "validation": ValidationJob}
JOB_KINDS_BY_TYPE = {kind: name for name, kind in JOB_TYPES.items()}


def read_job(path) -> Job:
    """The one reader of a job file: a Job or ValidationJob (by its `kind`), every field known,
    the spec checked; else JobError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobError(f"{path}: unreadable job file ({exc})") from None
    if not isinstance(data, dict):
        raise JobError(f"{path}: a job file holds a JSON object")
    kind = data.pop("kind", None)
    if kind not in JOB_TYPES:
        raise JobError(f"{path}: job field 'kind': {kind!r} is not one of {sorted(JOB_TYPES)}")
    job_type = JOB_TYPES[kind]
    known = {f.name for f in fields(job_type)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise JobError(f"{path}: unknown job field(s) {unknown} (a file this distlab did not write)")
    for name in ("spec", "run_dir"):
        if name not in data:
            raise JobError(f"{path}: job field '{name}' is missing")
    try:
        data["spec"] = Spec.checked(data["spec"], f"{path}")
    except SpecError as exc:
        raise JobError(str(exc)) from None
    return job_type(**data)

