"""Two hosts, one Ray cluster: the roadmap's "home PC + one cloud box over Ray", on one machine.

`snakemake two_hosts` makes two hosts on a link (distlab/launchers/links.py: each its own network
namespace and address, 10.77.0.1 "home-pc" and 10.77.0.2 "cloud-box", the link capped at
`two_hosts.bandwidth_mbit`), starts a Ray head on home-pc and a worker node on cloud-box
(`ray start`, token auth, distlab/launchers/ray_nodes.py), and runs one elastic Ray Train
experiment across both: the driver runs on home-pc and talks to the head at its own address,
as profiles/ray-head's driver does (a fixed ray.address instead of $RAY_ADDRESS). While it
trains, the cloud box leaves (its node is stopped) and joins again:

1. the 2-worker group writes a checkpoint (one rank on each host);
2. cloud-box's node is stopped; Ray restarts the group with 1 worker from the newest
   checkpoint (ScalingConfig(num_workers=(1, 2)), FailureConfig);
3. once that 1-worker group has checkpointed, cloud-box's node starts again; Ray's resize
   monitor restarts the group with 2 workers from the newest checkpoint;
4. the run finishes on both hosts.

Both hosts' results come back to one run folder and one card: the ranks' records through Ray
(metrics.json, its `ray` block: which host ran which rank in every worker group), the bytes
each host sent and received over the link (the kernel's counters), and the node events.
"""
from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

from distlab.records.job import Job, replace

HOST_NAMES = ("home-pc", "cloud-box")
# What the two-host experiment is unless `two_hosts.experiment` says otherwise.
DEFAULT_EXPERIMENT = {"strategy": "ddp", "micro_batch": 8, "steps": 60, "untimed_steps": 3, "checkpoint_every": 4,
                      "ray": {"min_workers": 1, "max_failures": 3, "resize_interval_s": 1}}
STAGE_WAIT_S = 300  # the longest wait for one of the run's stages (a checkpoint of a group size)


def two_hosts_spec(config: dict) -> dict:
    """The resolved spec of the two-host experiment (2 ranks, elastic down to 1, Ray launcher,
    the head at host 0's address), checked like every experiment."""
    from distlab.configuration.config import _deep_merge, expand_experiments
    from distlab.configuration.input_checks import ConfigError
    from distlab.launchers.ray_nodes import NAMESPACED_PORT
    from distlab.launchers.links import address

    block = config.get("two_hosts", {})
    override = _deep_merge(DEFAULT_EXPERIMENT, block.get("experiment", {}))
    override = _deep_merge(override, {"launcher": "ray", "world_size": 2, "tag": "two-hosts",
                                      "ray": {"address": f"{address(0)}:{NAMESPACED_PORT}"}})
    single = copy.deepcopy(config)
    single["stages"] = {"ray": {"experiments": [override]}}
    try:
        (spec,) = expand_experiments(single, gpu_count=0).values()
    except ConfigError as error:  # name the field the user wrote, not the synthetic stage
        raise ConfigError(str(error).replace("stages.ray.experiments[0]", "two_hosts.experiment")) from None
    return spec


def newest_checkpoint_world(run_dir: Path) -> int | None:
    """World size of the newest checkpoint the running job has written (resume/step-*)."""
    from distlab.records.checkpoint_files import step_folders

    for folder in reversed(step_folders(Path(run_dir) / "resume")):
        try:
            return json.loads((folder / "distlab_checkpoint.json").read_text())["world_size"]
        except (OSError, ValueError):
            continue  # being written or replaced right now
    return None


def wait_for_world(run_dir: Path, world: int, running, what: str, timeout: float = STAGE_WAIT_S) -> None:
    deadline = time.time() + timeout
    while newest_checkpoint_world(run_dir) != world:
        if not running():
            raise RuntimeError(f"the run ended before {what}")
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.3)


def run_two_hosts(job: Job, bandwidth_mbit: float | None, log_path: str, timeout: float) -> dict:
    """Make the hosts and the cluster, run the job across them with cloud-box leaving and
    rejoining, tear everything down. Returns the record of what happened to the hosts."""
    from distlab.jobs.launch import launch
    from distlab.launchers.ray_nodes import RayNodes
    from distlab.launchers.links import INTERFACE, LinkedHosts

    run_dir = Path(job.run_dir)
    events, outcome = [], {}

    def note(event: str, **extra) -> None:
        events.append({"event": event, "time": time.time(), "newest_checkpoint_world": newest_checkpoint_world(run_dir),
                       **extra})
        print(f"two hosts: {event}", flush=True)

    saved = dict(os.environ)
    with LinkedHosts(2, bandwidth_mbit) as hosts, RayNodes(head_cpus=job.spec.cpu_threads_per_rank,
                                                           hosts=hosts) as cluster:
        note("head started", host=HOST_NAMES[0], address=cluster.address)
        cluster.add_node(HOST_NAMES[1], cpus=job.spec.cpu_threads_per_rank, host=1)
        note("node joined", host=HOST_NAMES[1])
        # The driver (started inside home-pc) reaches the head with the cluster's token; gloo
        # of the Ray workers binds to each host's link interface.
        os.environ.update(cluster.env, GLOO_SOCKET_IFNAME=INTERFACE)
        # After cloud-box leaves, Ray's view of free resources lags and its first restart asks
        # for 2 workers again; it retries with what is there when that start times out (60 s
        # by default: most of the run's wall time here).
        os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")
        # The driver labels each rank's host by these names, never by address (ray_record).
        job = replace(job, driver_inside=hosts.inside(0, []),
                   host_names={hosts.address(i): name for i, name in enumerate(HOST_NAMES)})
        before = hosts.counters()
        namespaces = dict(hosts.namespaces)  # recorded: a check can see that they are gone afterwards

        def train():
            try:
                outcome["status"] = launch(job, log_path=log_path, timeout=timeout)
            except BaseException as exc:  # reported by the orchestrating thread
                outcome["error"] = exc

        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            wait_for_world(run_dir, 2, trainer.is_alive, "a checkpoint of the 2-worker group")
            cluster.stop_node(HOST_NAMES[1])
            note("node left", host=HOST_NAMES[1])
            wait_for_world(run_dir, 1, trainer.is_alive, "a checkpoint of the 1-worker group")
            cluster.add_node(HOST_NAMES[1], cpus=job.spec.cpu_threads_per_rank, host=1)
            note("node rejoined", host=HOST_NAMES[1])
            wait_for_world(run_dir, 2, trainer.is_alive, "the group to grow back to 2 workers")
            note("group grew back")
        finally:
            trainer.join(timeout=timeout)
            after = hosts.counters()
            os.environ.clear()
            os.environ.update(saved)
        note("run ended")
    if "error" in outcome:
        raise RuntimeError(f"the two-host run failed: {outcome['error']}") from outcome["error"]
    per_host = [{**{k: a[k] - b[k] if isinstance(a[k], int) and k != "host" else a[k] for k in a},
                 "host": HOST_NAMES[i]} for i, (a, b) in enumerate(zip(after, before))]
    return {"hosts": [{"name": HOST_NAMES[i], "address": hosts.address(i)} for i in range(2)], "namespaces": namespaces,
            "link": {"bandwidth_mbit": bandwidth_mbit, "per_host": per_host,
                     "how": "the kernel's counters of each host's eth0 over the whole run (both hosts' namespaces)"},
            "events": events, "status": outcome.get("status")}
