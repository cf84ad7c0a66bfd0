"""The Ray Train driver: the process the `ray` launcher starts by name (`python -m
distlab.rank.ray_train --job job.json`, distlab.launchers.ray_driver.run), as torchrun starts
distlab.rank.worker. It connects to the configured Ray cluster or starts a private one, fits a
`TorchTrainer` whose workers run distlab.rank.ray_worker.train_worker, and writes what rank 0
returned as metrics.json and steps.jsonl with the record of where each rank ran
(distlab.launchers.ray_record). What Ray brings, and how results come back: the launcher's
docstring (distlab.launchers.ray_driver).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from distlab.records.spec import Spec
from distlab.launchers.environment import BASE_ENV, FAULT_ENV
from distlab.launchers.ray_driver import PRIVATE_TEMP_DIR_ENV, resolve_address
from distlab.launchers.ray_record import earlier_rows, ray_record
from distlab.records.job import Job, collective_timeout, read_job, replace

HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives its head node only


def scaling(spec: Spec) -> tuple[int | tuple[int, int], dict]:
    """num_workers (fixed, or (min, max) when elastic) and what each worker reserves."""
    low = spec.ray["min_workers"]
    counts = spec.world_size if low in (None, spec.world_size) else (low, spec.world_size)
    resources = {"CPU": spec.cpu_threads_per_rank, **({"GPU": 1} if spec.device == "cuda" else {})}
    return counts, resources


def worker_environment(spec: Spec) -> dict:
    """What each Ray worker process gets (Ray workers inherit the raylet's env, not ours)."""
    env = dict(BASE_ENV, OMP_NUM_THREADS=str(spec.cpu_threads_per_rank))
    if spec.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    # The fault-injection test hook reaches the workers too; so does the link interface gloo
    # must use on namespaced hosts (distlab/jobs/two_hosts.py).
    for key in (FAULT_ENV, "GLOO_SOCKET_IFNAME"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


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
def ray_cluster(spec: Spec):
    """Connect to the configured head, or start a local instance sized like the job's
    Snakemake resources (world_size x cpu_threads_per_rank cores, world_size GPUs on cuda)."""
    import ray

    address = resolve_address(spec)
    if address:
        ray.init(address=address)
        # Not the address itself: shared results name no machine of the cluster (ray_record).
        cluster = {"mode": "existing cluster",
                   "address_from": "RAY_ADDRESS" if spec.ray["address"] == "env" else "ray.address"}
    else:
        cpus = spec.world_size * spec.cpu_threads_per_rank
        gpus = spec.world_size if spec.device == "cuda" else 0
        # The temp dir (and its token) were made by run_ray, which removes them afterwards.
        ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
                 _temp_dir=os.environ[PRIVATE_TEMP_DIR_ENV])
        cluster = {"mode": "local instance started for this job", "address": None, "num_cpus": cpus, "num_gpus": gpus}
    try:
        yield cluster
    finally:
        ray.shutdown()


def cluster_nodes() -> list[dict]:
    import ray

    # node_ip becomes a host label before anything is written (ray_record.host_labels).
    return [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"], "alive": n["Alive"],
             "head": HEAD_RESOURCE in n["Resources"],
             "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}}
            for n in ray.nodes()]


def fit(job: Job) -> dict:
    """Run the experiment on the current Ray cluster; returns what the driver writes."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    spec = job.spec
    # Ray workers run in their own working directory: hand them absolute paths (a hub id
    # for the model stays as it is).
    job = replace(job, **{key: os.path.abspath(getattr(job, key)) for key in
                          ("run_dir", "data_dir", "hardware_json", "checkpoint_dir", "model_source")
                          if getattr(job, key) and (key != "model_source" or os.path.exists(getattr(job, key)))})
    # On the driver's own node: placed anywhere, it can land on a worker node that leaves the
    # elastic run (two_hosts stops cloud-box), and the events die with it.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    run_log = _run_log_class().options(scheduling_strategy=here).remote()
    counts, resources = scaling(spec)
    scaling_config = ScalingConfig(num_workers=counts, use_gpu=spec.device == "cuda",
                                   resources_per_worker=resources,
                                   elastic_resize_monitor_interval_s=spec.ray["resize_interval_s"])
    storage = spec.ray["storage_path"] or os.path.abspath(os.path.join(job.run_dir, "ray"))
    run_config = RunConfig(name=spec.id, storage_path=storage,
                           failure_config=FailureConfig(max_failures=spec.ray["max_failures"]),
                           checkpoint_config=CheckpointConfig(num_to_keep=2),
                           worker_runtime_env={"env_vars": worker_environment(spec)})
    from distlab.rank.ray_worker import train_worker

    trainer = TorchTrainer(train_worker, train_loop_config={"job": job, "log": run_log},
                           scaling_config=scaling_config, run_config=run_config,
                           # The process group Ray makes waits no longer than the job may run.
                           torch_config=TorchConfig(timeout_s=int(collective_timeout(job, spec).total_seconds())))
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
                      "resize_interval_s": spec.ray["resize_interval_s"]}
    return {"result": result, "error": error, "events": events, "fit_seconds": fit_seconds, "scaling": scaling_record,
            "max_failures": spec.ray["max_failures"], "storage_path": storage, "nodes": cluster_nodes()}


def write_results(job: Job, outcome: dict, cluster: dict) -> None:
    from distlab.records.run_outputs import write_outputs

    spec = job.spec
    returned = outcome["result"].return_value
    metrics, steps = returned["metrics"], returned["steps"]
    record = ray_record(outcome, cluster, job.host_names)
    record["final_group"] = {"world_size": metrics["spec"].world_size,
                             "untimed_steps": metrics["timing"]["untimed_steps"],
                             "start_step": record["attempts"][-1]["start_step"] if record["attempts"] else 0}
    # steps.jsonl keeps the rows of the world size the timing is about; the loss curve spans all.
    record["earlier_groups_steps"] = earlier_rows(record["attempts"], steps, spec.steps)
    losses = [row["loss"] for row in record["earlier_groups_steps"] + steps]
    metrics.update(spec=spec, ray=record, loss={"first": losses[0], "last": losses[-1], "per_step": losses})
    if record["world_size_changes"]:
        metrics["timing"]["how"] += ("; after an elastic resize only the last worker group's steps are timed "
                                     "(steps.jsonl); earlier groups' rows are in ray.earlier_groups_steps")
    write_outputs(job.run_dir, (metrics, steps))
    if spec.ray["storage_path"] is None:
        # Ray's copies of the periodic checkpoints: needed only while the run could still resume.
        shutil.rmtree(outcome["storage_path"], ignore_errors=True)


def drive(job: Job) -> None:
    with ray_cluster(job.spec) as cluster:
        outcome = fit(job)
    if outcome["error"] is not None or outcome["result"].return_value is None:
        for event in outcome["events"]:  # oom-rank<N>.json: distlab.jobs.launch then records status 'oom'
            if event["event"] == "oom":
                Path(job.run_dir, f"oom-rank{event['rank']}.json").write_text(json.dumps(
                    {"rank": event["rank"], "error": event["error"], "memory": {}}))
        raise RuntimeError(f"Ray Train run failed: {outcome['error'] or 'rank 0 returned nothing'}")
    write_results(job, outcome, cluster)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Ray Train driver of one distlab experiment")
    parser.add_argument("--job", required=True, help="job.json written by distlab.jobs.launch")
    args = parser.parse_args(argv)
    drive(read_job(args.job))


if __name__ == "__main__":
    main()  # results written and ray.shutdown() done (ray_cluster)
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()  # skip the interpreter's teardown of torch, transformers and Ray
