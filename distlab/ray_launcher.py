"""The `ray` launcher: the ranks of distlab.worker.run_rank run as Ray Train v2 workers.

`TorchTrainer` places one worker per rank and sets up the torch process group (gloo on
CPU, nccl on GPU); Strategy.init_distributed finds it initialized and joins it. The loop
and the checkpoint format are the ones torchrun runs use; this module adds what Ray
brings: every checkpoint is reported with `ray.train.report`, a restarted worker group
(FailureConfig max_failures, or an elastic resize with ScalingConfig(num_workers=(min,
max))) resumes from `ray.train.get_checkpoint()`, and where each rank ran is recorded.

What comes back to this machine, and how:
- metrics and per-step rows: rank 0's training function returns them; Ray hands them to
  the driver (`Result.return_value`), which writes metrics.json and steps.jsonl. No
  shared filesystem needed.
- events (worker groups, node and pid of each rank, checkpoints, injected faults): a
  `RunLog` actor the driver owns; workers send it records. No shared filesystem needed.
- checkpoints: the ranks write them into the run folder (resume/, checkpoint/final), the
  same collective format torchrun runs write, so every node must see the run folder (one
  machine; NFS; a KubeRay volume claim). Ray keeps its own copies of the periodic ones in
  `ray.storage_path` (default <run dir>/ray, removed after a successful run).
- inputs (prepared data, base model) are read by path: the same paths on every node.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

PRIVATE_TEMP_DIR_ENV = "DISTLAB_RAY_TEMP_DIR"

# -- configuration -------------------------------------------------------------------------
def resolve_address(spec: dict) -> str | None:
    """None = start a local Ray instance for this job; "env" = $RAY_ADDRESS (must be set)."""
    address = spec["ray"]["address"]
    if address == "env":
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise RuntimeError("ray.address is 'env' but RAY_ADDRESS is not set in the environment")
    return address


def scaling(spec: dict) -> tuple[int | tuple[int, int], dict]:
    """num_workers (fixed, or (min, max) when elastic) and what each worker reserves."""
    low = spec["ray"]["min_workers"]
    counts = spec["world_size"] if low in (None, spec["world_size"]) else (low, spec["world_size"])
    resources = {"CPU": spec["cpu_threads_per_rank"], **({"GPU": 1} if spec["device"] == "cuda" else {})}
    return counts, resources


def worker_environment(spec: dict) -> dict:
    """What each Ray worker process gets (Ray workers inherit the raylet's env, not ours)."""
    from distlab.launch import BASE_ENV

    env = dict(BASE_ENV, OMP_NUM_THREADS=str(spec["cpu_threads_per_rank"]))
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    from distlab.checkpoint import FAULT_ENV

    if os.environ.get(FAULT_ENV):  # the fault-injection test hook reaches the workers too
        env[FAULT_ENV] = os.environ[FAULT_ENV]
    return env


# -- worker side ---------------------------------------------------------------------------
def node_identity() -> dict:
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid()}


def _ray_checkpoints_class():
    """TrainingCheckpoints (distlab.worker) that also tells Ray about every checkpoint and
    resumes from the one Ray hands back; built on first use so that importing this module
    (distlab.launch does) loads neither torch nor Ray."""
    import ray
    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint

    from distlab import checkpoint as ckpt
    from distlab.worker import TrainingCheckpoints

    class RayCheckpoints(TrainingCheckpoints):
        run_log = None  # the driver's RunLog actor, set by train_worker

        def resume(self) -> int:
            found = ray.train.get_checkpoint()
            if found is None:
                steps = super().resume()  # a rerun of a killed Snakemake job may still resume from resume/
                self._log_start(steps, None)
                return steps
            with found.as_directory() as folder:
                meta = ckpt.read_meta(folder)
                same_world = meta["world_size"] == dist.get_world_size()
                # Same world size: the exact trainer state (data position, RNG, records). After an
                # elastic resize only the model and optimizer carry over; the data is re-sharded.
                info = ckpt.load_checkpoint(folder, self.strategy, self.ctx, self.signature,
                                            stream=self.stream if same_world else None,
                                            allow_world_size=not same_world)
                earlier = [] if same_world else earlier_losses(Path(folder), meta["world_size"])
            steps = info["steps_done"]
            if same_world:
                self.records[:] = info["records"]
            else:
                for _ in range(steps * self.spec["grad_accum"]):
                    self.stream.next()
                # This group times only its own steps: keep at least one after its warm-up.
                self.spec["warmup_steps"] = min(self.spec["warmup_steps"], max(0, self.spec["steps"] - steps - 1))
            self.report["resumed_from_steps"] = steps
            self._log_start(steps, {"from_world_size": meta["world_size"], "earlier_losses": earlier})
            return steps

        def _log_start(self, steps: int, restored: dict | None) -> None:
            event = {"event": "rank_started", "time": time.time(), "rank": dist.get_rank(),
                     "world_size": dist.get_world_size(), "start_step": steps, "resumed": restored is not None,
                     **node_identity()}
            if restored and dist.get_rank() == 0:
                event.update(restored)
            ray.get(self.run_log.add.remote(event))

        def on_step_end(self, step: int) -> None:
            # The fault-injection test hook (distlab.checkpoint.FAULT_ENV) fires here instead,
            # after Ray has been told of this step's checkpoint, and once per run: a group that
            # resumes before the step must not be killed again.
            fault = os.environ.pop(ckpt.FAULT_ENV, None) or getattr(self, "fault", None)
            self.fault = fault
            saves = len(self.report["periodic_saves"])
            super().on_step_end(step)
            done = step + 1
            if len(self.report["periodic_saves"]) > saves:
                folder = self.resume_root / f"step-{done:06d}"
                ray.train.report({"steps_done": done, "world_size": dist.get_world_size()},
                                 checkpoint=Checkpoint.from_directory(str(folder)) if dist.get_rank() == 0 else None,
                                 checkpoint_dir_name=f"step-{done:06d}")
                if dist.get_rank() == 0:
                    ray.get(self.run_log.add.remote({"event": "checkpoint", "time": time.time(), "steps_done": done,
                                                     "world_size": dist.get_world_size()}))
            if fault and fault.rsplit(":", 2) == [self.spec["id"], str(dist.get_rank()), str(done)] \
                    and not ray.get(self.run_log.count.remote("fault_injected")):
                ray.get(self.run_log.add.remote({"event": "fault_injected", "time": time.time(),
                                                 "rank": dist.get_rank(), "steps_done": done, "signal": "SIGKILL",
                                                 **node_identity()}))
                os.environ[ckpt.FAULT_ENV] = fault
                ckpt.maybe_inject_fault(self.spec, done)

    return RayCheckpoints


def earlier_losses(folder: Path, world_size: int) -> list[dict]:
    """Mean loss per step over the ranks of the world a checkpoint was saved in (its
    trainer/rank<R>.json records), for the curve across an elastic resize."""
    per_rank = [json.loads((folder / "trainer" / f"rank{r}.json").read_text())["records"] for r in range(world_size)]
    rows = []
    for i, record in enumerate(per_rank[0]):
        values = [recs[i]["loss"] for recs in per_rank if recs[i]["loss"] is not None]
        rows.append({"step": record["step"], "loss": sum(values) / len(values) if values else None,
                     "step_time_s": max(recs[i]["step_time_s"] for recs in per_rank), "world_size": world_size})
    return rows


def train_worker(config: dict):
    """What every Ray Train worker runs: distlab.worker.run_rank with Ray-aware checkpoints."""
    import ray
    import ray.train
    import torch

    from distlab import worker

    job = dict(config["job"])
    spec = dict(job["spec"])
    # An elastic group may hold fewer than max_workers: the rank code checks the world size
    # it really got against this group's size (Ray checked it is within [min, max]).
    spec["world_size"] = ray.train.get_context().get_world_size()
    job["spec"] = spec
    if spec["device"] == "cuda":
        import ray.train.torch

        # Ray gives each worker its GPU and may share CUDA_VISIBLE_DEVICES between the
        # workers of a node; LOCAL_RANK must name the device Ray chose, whose index in
        # that list need not equal the local rank.
        os.environ["LOCAL_RANK"] = str(ray.train.torch.get_device().index)
    checkpoints_class = _ray_checkpoints_class()
    checkpoints_class.run_log = config["log"]
    try:
        summary = worker.run_rank(job, checkpoints_class=checkpoints_class)
    except torch.OutOfMemoryError as error:
        ray.get(config["log"].add.remote({"event": "oom", "rank": ray.train.get_context().get_world_rank(),
                                          "time": time.time(), "error": str(error).splitlines()[0][:500]}))
        raise
    return None if summary is None else dict(zip(("metrics", "steps"), summary))


# -- driver side ---------------------------------------------------------------------------
def _run_log_class():
    import ray

    @ray.remote(num_cpus=0)
    class RunLog:
        """Events the workers send to the driver (works without a shared filesystem)."""

        def __init__(self):
            self.events = []

        def add(self, event: dict) -> None:
            self.events.append(event)

        def count(self, kind: str) -> int:
            return sum(e["event"] == kind for e in self.events)

        def all(self) -> list[dict]:
            return self.events

    return RunLog


@contextlib.contextmanager
def ray_cluster(spec: dict):
    """Connect to the configured head, or start a local instance sized like the job's
    Snakemake resources (world_size x cpu_threads_per_rank cores, world_size GPUs on cuda)."""
    import ray

    address = resolve_address(spec)
    if address:
        ray.init(address=address)
        cluster = {"mode": "existing cluster", "address": address}
    else:
        cpus = spec["world_size"] * spec["cpu_threads_per_rank"]
        gpus = spec["world_size"] if spec["device"] == "cuda" else 0
        # The temp dir (and its token) were made by run_ray, which removes them afterwards.
        ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
                 _temp_dir=os.environ[PRIVATE_TEMP_DIR_ENV])
        cluster = {"mode": "local instance started for this job", "address": None, "num_cpus": cpus, "num_gpus": gpus}
    try:
        yield cluster
    finally:
        ray.shutdown()


def private_instance_environment(folder: str) -> dict:
    """Token auth stays on for a job's private Ray instance, but its token lives in the
    instance's temp dir (mode 600) instead of ~/.ray: a fresh CI box may have no writable
    home, and concurrent jobs must not race on one token file. Ray reads these at import,
    so they go into the driver's environment before it starts."""
    path = Path(folder, "auth_token")
    path.write_text(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes: 256 random bits
    path.chmod(0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path), PRIVATE_TEMP_DIR_ENV: folder,
            # A job's own instance has no node a cloud could preempt: skip the watcher process.
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def cluster_nodes() -> list[dict]:
    import ray

    return [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"], "alive": n["Alive"],
             "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
            for n in ray.nodes()]


def attempts_from_events(events: list[dict]) -> list[dict]:
    """Group rank_started events into worker-group attempts, in time order."""
    attempts = []
    for event in sorted((e for e in events if e["event"] == "rank_started"), key=lambda e: e["time"]):
        current = attempts[-1] if attempts else None
        same = (current and current["world_size"] == event["world_size"]
                and current["start_step"] == event["start_step"] and event["rank"] not in current["ranks"])
        if not same:
            current = {"world_size": event["world_size"], "start_step": event["start_step"],
                       "resumed": event["resumed"], "ranks": {}}
            attempts.append(current)
        current["ranks"][event["rank"]] = {k: event[k] for k in ("node_id", "node_ip", "hostname", "pid")}
        for key in ("from_world_size", "earlier_losses"):
            if key in event:
                current[key] = event[key]
    for attempt in attempts:
        attempt["ranks"] = [dict(rank=r, **attempt["ranks"][r]) for r in sorted(attempt["ranks"])]
        attempt["nodes"] = sorted({r["node_id"] for r in attempt["ranks"]})
    return attempts


def fit(job: dict) -> dict:
    """Run the experiment on the current Ray cluster; returns what the driver writes."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    spec = job["spec"]
    # Ray workers run in their own working directory: hand them absolute paths (a hub id
    # for the model stays as it is).
    job = dict(job, **{key: os.path.abspath(job[key]) for key in
                       ("run_dir", "data_dir", "hardware_json", "checkpoint_dir", "model_source")
                       if job.get(key) and (key != "model_source" or os.path.exists(job[key]))})
    run_log = _run_log_class().remote()
    counts, resources = scaling(spec)
    scaling_config = ScalingConfig(num_workers=counts, use_gpu=spec["device"] == "cuda",
                                   resources_per_worker=resources,
                                   elastic_resize_monitor_interval_s=spec["ray"]["resize_interval_s"])
    storage = spec["ray"]["storage_path"] or os.path.abspath(os.path.join(job["run_dir"], "ray"))
    run_config = RunConfig(name=spec["id"], storage_path=storage,
                           failure_config=FailureConfig(max_failures=spec["ray"]["max_failures"]),
                           checkpoint_config=CheckpointConfig(num_to_keep=2),
                           worker_runtime_env={"env_vars": worker_environment(spec)})
    from distlab.ray_launcher import train_worker  # by module name, also when this file runs as __main__

    trainer = TorchTrainer(train_worker, train_loop_config={"job": job, "log": run_log},
                           scaling_config=scaling_config, run_config=run_config)
    started = time.perf_counter()
    error = None
    try:
        result = trainer.fit()
    except Exception as exc:  # recorded below, then re-raised by main()
        result, error = None, exc
    fit_seconds = time.perf_counter() - started
    events = ray.get(run_log.all.remote())
    scaling_record = {"num_workers": counts, "elastic": isinstance(counts, tuple), "use_gpu": scaling_config.use_gpu,
                      "resources_per_worker": resources,
                      "resize_interval_s": spec["ray"]["resize_interval_s"]}
    return {"result": result, "error": error, "events": events, "fit_seconds": fit_seconds, "scaling": scaling_record,
            "max_failures": spec["ray"]["max_failures"], "storage_path": storage, "nodes": cluster_nodes()}


def ray_record(outcome: dict, cluster: dict) -> dict:
    """metrics.json's `ray` block: what Ray really did, from the workers' own reports."""
    import ray

    attempts = attempts_from_events(outcome["events"])
    final = attempts[-1] if attempts else None
    return {
        "launcher": "ray",
        "ray_version": ray.__version__,
        "cluster": cluster,
        "nodes_in_cluster": outcome["nodes"],
        "scaling": outcome["scaling"],
        "max_failures": outcome["max_failures"],
        "storage_path": outcome["storage_path"],
        "world_size": final["world_size"] if final else None,
        "ranks": final["ranks"] if final else [],
        "distinct_nodes": len(final["nodes"]) if final else 0,
        "attempts": attempts,
        "restarts": max(0, len(attempts) - 1),
        "world_size_changes": [{"step": after["start_step"], "from": before["world_size"], "to": after["world_size"],
                                "resumed_from_checkpoint": after["resumed"]}
                               for before, after in zip(attempts, attempts[1:])
                               if before["world_size"] != after["world_size"]],
        "faults_injected": [e for e in outcome["events"] if e["event"] == "fault_injected"],
        "checkpoints": [e for e in outcome["events"] if e["event"] == "checkpoint"],
        "fit_seconds": outcome["fit_seconds"],
        "how": "ranks, nodes and groups from the workers' own start records (RunLog actor); fit_seconds = wall "
               "time of TorchTrainer.fit() in the driver; metrics and steps returned by rank 0 "
               "(Result.return_value); checkpoints written into the run folder and reported to Ray",
    }


def earlier_rows(attempts: list[dict], steps: list[dict], total: int) -> list[dict]:
    """Loss rows of the steps before the last elastic resize, from the records that resize's
    checkpoint carried (later groups override earlier ones). Renumbers `steps`, which an
    elastic group counts from its own first step."""
    if len(steps) < total:
        for row in steps:
            row["step"] += total - len(steps)
    first = steps[0]["step"] if steps else total
    rows = {}
    for attempt in attempts:
        for row in attempt.get("earlier_losses") or []:
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows) if k < first]


def write_results(job: dict, outcome: dict, cluster: dict) -> None:
    from distlab.worker import write_outputs

    spec = job["spec"]
    returned = outcome["result"].return_value
    metrics, steps = returned["metrics"], returned["steps"]
    group_spec = metrics["spec"]
    record = ray_record(outcome, cluster)
    record["final_group"] = {"world_size": group_spec["world_size"], "warmup_steps": group_spec["warmup_steps"],
                             "start_step": record["attempts"][-1]["start_step"] if record["attempts"] else 0}
    # steps.jsonl keeps the rows of the world size the timing is about; the loss curve spans all.
    record["earlier_groups_steps"] = earlier_rows(record["attempts"], steps, spec["steps"])
    losses = [row["loss"] for row in record["earlier_groups_steps"] + steps]
    metrics.update(spec=spec, ray=record, loss={"first": losses[0], "last": losses[-1], "per_step": losses})
    if record["world_size_changes"]:
        metrics["timing"]["how"] += ("; after an elastic resize only the last worker group's steps are timed "
                                     "(steps.jsonl); earlier groups' rows are in ray.earlier_groups_steps")
    write_outputs(job["run_dir"], (metrics, steps))
    if spec["ray"]["storage_path"] is None:
        # Ray's copies of the periodic checkpoints: needed only while the run could still resume.
        shutil.rmtree(outcome["storage_path"], ignore_errors=True)


def drive(job: dict) -> None:
    with ray_cluster(job["spec"]) as cluster:
        outcome = fit(job)
    if outcome["error"] is not None or outcome["result"].return_value is None:
        for event in outcome["events"]:  # oom-rank<N>.json: distlab.launch then records status 'oom'
            if event["event"] == "oom":
                Path(job["run_dir"], f"oom-rank{event['rank']}.json").write_text(json.dumps(
                    {"rank": event["rank"], "error": event["error"], "memory": {}}))
        raise RuntimeError(f"Ray Train run failed: {outcome['error'] or 'rank 0 returned nothing'}")
    write_results(job, outcome, cluster)


def run_ray(job: dict, job_path: str, log_path: str | None, timeout: float | None) -> None:
    """LAUNCHERS entry: the Ray driver runs in its own process, its output in the job's log."""
    from distlab.launch import _run, rank_environment

    env = rank_environment(job["spec"])
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    command = [sys.executable, "-m", "distlab.ray_launcher", "--job", job_path]
    if resolve_address(job["spec"]):
        _run(command, env, log_path, timeout)
        return
    # A short private temp dir: concurrent jobs never share a Ray session, and unix socket
    # paths stay under the OS length limit.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        env.update(private_instance_environment(temp_dir))
        _run(command, env, log_path, timeout)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Ray Train driver of one distlab experiment")
    parser.add_argument("--job", required=True, help="job.json written by distlab.launch")
    args = parser.parse_args(argv)
    drive(json.loads(Path(args.job).read_text()))


if __name__ == "__main__":
    main()
