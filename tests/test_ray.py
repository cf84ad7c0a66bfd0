"""Stage 5 promises: the same training code under Ray Train, on a real Ray cluster.

One cluster serves the module: `ray start --head` on 127.0.0.1 plus a second
`ray start --address ...` node on the same machine standing in for another machine
(distlab.launchers.ray_nodes; the same nodes on two namespaced hosts: tests/test_two_hosts.py).
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, resolve, run_experiment, seed_hardware, snakemake, tiny_config

from distlab.records.job import Job
from distlab.launchers.ray_nodes import RayNodes
from distlab.records.run_outputs import read_run_record
from distlab.jobs.two_hosts import newest_checkpoint_world

# Every test runs on the module's Ray cluster.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU) + one more node (1 CPU): a 2-rank run must put one rank on each."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN",
                                            "RAY_USAGE_STATS_ENABLED")}
    ray_cluster = RayNodes(head_cpus=1)
    try:
        ray_cluster.add_node("second", cpus=1)
        os.environ.update(ray_cluster.env)  # the pipeline's driver connects with the cluster's token
        os.environ.pop("RAY_AUTH_TOKEN", None)
        yield ray_cluster
    finally:
        ray_cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_driver_without_the_cluster_s_token_is_refused_by_the_head(cluster, tmp_path):
    """Token auth is on for the nodes distlab starts (docs/ray.md's two-machine recipe): a
    client with no token (no RAY_AUTH_*, no ~/.ray) is refused; the same client with the
    cluster's token connects."""
    import subprocess
    import sys

    connect = f"import ray; ray.init(address={cluster.address!r}); print('connected')"
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    bare["HOME"] = str(tmp_path)
    refused = subprocess.run([sys.executable, "-c", connect], env=bare, capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0 and "connected" not in refused.stdout
    assert "AuthenticationError" in refused.stderr and "token is missing or incorrect" in refused.stderr
    with_token = subprocess.run([sys.executable, "-c", connect], env={**bare, **cluster.env}, capture_output=True,
                                text=True, timeout=180)
    assert with_token.returncode == 0 and "connected" in with_token.stdout, with_token.stderr[-2000:]


SHORT = {"steps": 8, "untimed_steps": 2, "checkpoint_every": 2}


def on_cluster(cluster, overrides: dict) -> dict:
    ray = {"address": cluster.address, **overrides.get("ray", {})}
    return resolve({"world_size": 2, "launcher": "ray", **SHORT, **overrides, "ray": ray}, stage="ray")


def load_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoint" / "final" / "state" / "model.safetensors"))


def assert_same_training(a_dir: Path, a: dict, b_dir: Path, b: dict) -> None:
    assert len(a["loss"]["per_step"]) == len(b["loss"]["per_step"]) == SHORT["steps"]
    for x, y in zip(a["loss"]["per_step"], b["loss"]["per_step"]):
        assert abs(x - y) < 1e-5, (a["loss"]["per_step"], b["loss"]["per_step"])
    assert a["loss"]["per_step"][-1] < a["loss"]["per_step"][0]  # a real trajectory, not two constants
    got, want = load_weights(a_dir), load_weights(b_dir)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max().item() < 1e-5, name


@pytest.fixture(scope="module")
def two_node_run(prepared, cluster, tmp_path_factory):
    """The pipeline itself, pointed at the cluster: `RAY_ADDRESS=... snakemake --profile
    profiles/ray-head`, reusing the prepared tokenizer and model (same data, same weights)."""
    workdir = tmp_path_factory.mktemp("two-node")
    seed_hardware(prepared, workdir, "testbox")
    config = tiny_config({"ray": {"experiments": [{"world_size": 2, "launcher": "ray", **SHORT}]}}, machine="testbox")
    config["data"]["tokenizer"] = str(prepared / "tokenizer")
    config["model"]["path"] = str(prepared / "model")
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        snakemake(workdir, "--profile", str(REPO / "profiles" / "ray-head"), "--cores", "2",
                  "results/testbox/ddp-full-w2-mb4-ga1-ray/metrics.json", config=config)
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = previous
    run_dir = workdir / "results" / "testbox" / "ddp-full-w2-mb4-ga1-ray"
    return run_dir, read_run_record(run_dir / "metrics.json").to_dict()


def test_two_node_ray_run_puts_one_rank_on_each_node_and_records_where(two_node_run, cluster):
    run_dir, metrics = two_node_run
    ray = metrics["ray"]
    assert metrics["spec"]["ray"]["address"] == "env"  # from profiles/ray-head, resolved from RAY_ADDRESS
    assert metrics["status"] == "ok" and ray["launcher"] == "ray" and ray["cluster"]["address_from"] == "RAY_ADDRESS"
    assert ray["world_size"] == 2 and metrics["as_built"]["world_size"] == 2
    assert metrics["as_built"]["outer_wrapper"] == "DistributedDataParallel"
    assert metrics["as_built"]["backend"] == "gloo"
    alive = {n["node_id"] for n in ray["nodes_in_cluster"] if n["alive"]}
    assert len(alive) == 2
    assert {r["node_id"] for r in ray["ranks"]} == alive, ray["ranks"]  # one rank per node, both recorded
    # Both nodes run on 127.0.0.1: one host, labelled as the head's (no address is written).
    assert ray["cluster"]["head_host"] == "host-1" and {r["host"] for r in ray["ranks"]} == {"host-1"}
    assert ray["distinct_nodes"] == 2 and ray["restarts"] == 0
    assert [c["steps_done"] for c in ray["checkpoints"]] == [2, 4, 6]  # each reported to Ray
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == SHORT["steps"]


IPV4 = re.compile(rb"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")


def test_a_ray_runs_shared_results_carry_host_labels_not_node_addresses(two_node_run):
    from distlab.report.cards.stage5_ray import build

    run_dir, metrics = two_node_run
    results = run_dir.parent.parent
    # Every file distlab wrote under results/ but the logs (Ray's own messages print addresses).
    found = {str(p.relative_to(results)): IPV4.findall(p.read_bytes()) for p in results.rglob("*")
             if p.is_file() and p.suffix != ".log"}
    assert not {name: hits for name, hits in found.items() if hits}
    from card_runs import changed, report_run

    run = changed(report_run(run_dir), machine="testbox", experiment=run_dir.name)
    (placement,) = [note for note in build([run]).notes if ": rank 0 -> node" in note]
    assert placement.count("on host-1") == 2, placement  # the card still says where each rank ran


def test_ray_launcher_trains_exactly_like_torchrun(prepared, tmp_path, two_node_run):
    run_dir, metrics = two_node_run
    reference = run_experiment(prepared, tmp_path / "torchrun", resolve({"world_size": 2, **SHORT}))
    assert reference["spec"]["launcher"] == "torchrun"
    assert_same_training(run_dir, metrics, tmp_path / "torchrun", reference)


def test_killed_ray_worker_is_replaced_and_training_resumes_from_the_last_checkpoint(
        prepared, tmp_path, cluster, two_node_run, monkeypatch):
    spec = on_cluster(cluster, {"ray": {"max_failures": 1}})
    # Rank 1 SIGKILLs itself right after step 4, its checkpoint reported to Ray first.
    monkeypatch.setenv("DISTLAB_FAULT_KILL", f"{spec['id']}:1:4")
    faulty = run_experiment(prepared, tmp_path / "fault", spec)
    ray = faulty["ray"]
    assert [(f["rank"], f["steps_done"]) for f in ray["faults_injected"]] == [(1, 4)]
    assert ray["restarts"] == 1 and ray["world_size_changes"] == []
    first, second = ray["attempts"]
    # Ray hands back the newest checkpoint it committed before the failure (step 4, or 2
    # if the kill won the race with the commit); training never starts over.
    assert second["resumed"] and second["start_step"] in (2, 4) and second["world_size"] == 2
    assert not {r["pid"] for r in second["ranks"]} & {r["pid"] for r in first["ranks"]}  # new processes
    # The final state is the one an uninterrupted run reaches.
    run_dir, uninterrupted = two_node_run
    assert_same_training(tmp_path / "fault", faulty, run_dir, uninterrupted)


def test_embedded_default_starts_a_private_local_ray_instance_in_a_fresh_home(prepared, tmp_path, monkeypatch,
                                                                             two_node_run):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # a fresh CI box: no ~/.ray, no token anywhere
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    spec = resolve({"world_size": 2, "launcher": "ray", **SHORT}, stage="ray")
    assert spec["ray"]["address"] is None
    metrics = run_experiment(prepared, tmp_path / "local", spec)
    ray = metrics["ray"]
    assert ray["cluster"]["mode"] == "local instance started for this job"
    assert ray["cluster"]["num_cpus"] == 2 and ray["cluster"]["num_gpus"] == 0  # the job's Snakemake threads
    assert [n["resources"]["CPU"] for n in ray["nodes_in_cluster"]] == [2.0]
    assert ray["world_size"] == 2 and ray["distinct_nodes"] == 1
    assert not (home / ".ray").exists()  # the token lived in the instance's temp dir
    run_dir, on_cluster_run = two_node_run
    assert_same_training(tmp_path / "local", metrics, run_dir, on_cluster_run)


def test_elastic_ray_run_grows_when_a_node_joins_and_shrinks_when_it_leaves(prepared, tmp_path, cluster,
                                                                           monkeypatch):
    # After a node leaves, Ray's view of free resources can lag and its first restart asks for
    # the old size; it retries when the group start times out (Ray's knob, 60 s by default).
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    # Two 1-CPU nodes hold 2 of the 3 wanted workers; a third node joins, then leaves.
    spec = resolve({"world_size": 3, "launcher": "ray", "micro_batch": 32, "steps": 300, "untimed_steps": 2,
                    "checkpoint_every": 10, "ray": {"address": cluster.address, "min_workers": 2,
                                                    "max_failures": 3, "resize_interval_s": 1}}, stage="ray")
    run_dir = tmp_path / "elastic"
    outcome: dict = {}

    def run():
        try:
            from distlab.jobs.launch import launch

            # run_experiment's job, with room for three worker-group restarts on a busy box
            job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(prepared / "data32"),
                      model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
                      env_allowlist=[], checkpoint_dir=str(run_dir / "checkpoint"))
            launch(job, log_path=str(run_dir / "train.log"), timeout=900)
            outcome["metrics"] = read_run_record(run_dir / "metrics.json").to_dict()
        except BaseException as exc:  # reported by the main thread
            outcome["error"] = exc

    def wait_for(world: int, what: str) -> None:
        deadline = time.time() + 240
        while newest_checkpoint_world(run_dir) != world:
            assert worker.is_alive(), f"the run ended before {what}: {outcome}"
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        wait_for(2, "a checkpoint of the 2-worker group")
        cluster.add_node("third", cpus=1)
        wait_for(3, "the group to grow to 3 workers")
        cluster.crash_node("third")
    finally:
        worker.join(timeout=600)
        if "third" in cluster.nodes:
            cluster.stop_node("third")
    assert "error" not in outcome, outcome.get("error")
    metrics = outcome["metrics"]
    changes = [(c["from"], c["to"]) for c in metrics["ray"]["world_size_changes"]]
    assert changes[:2] == [(2, 3), (3, 2)], metrics["ray"]["world_size_changes"]
    steps = [c["step"] for c in metrics["ray"]["world_size_changes"]]
    assert 0 < steps[0] <= steps[1] < spec["steps"]  # each change recorded at the checkpoint it resumed from
    assert metrics["ray"]["world_size"] == 2 and metrics["as_built"]["world_size"] == 2
    grown = next(a for a in metrics["ray"]["attempts"] if a["world_size"] == 3)
    assert len(grown["nodes"]) == 3  # the joined node really ran a rank
    assert len(metrics["loss"]["per_step"]) == spec["steps"] and None not in metrics["loss"]["per_step"]
