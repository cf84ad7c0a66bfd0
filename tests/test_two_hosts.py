"""Two hosts, one Ray cluster: `snakemake two_hosts` puts a Ray head and a worker node on two
namespaced hosts and trains across both while the worker node leaves and rejoins
(distlab/jobs/two_hosts.py). Needs root (network namespaces); skipped elsewhere with the reason."""
import json

import pytest

from conftest import seed_hardware, snakemake, tiny_config

from distlab.launchers import links
from distlab.records.run_outputs import read_run_record

pytestmark = pytest.mark.skipif(bool(links.refusal()), reason=f"links cannot be made here: {links.refusal()}")


@pytest.fixture(scope="module")
def two_hosts(prepared, tmp_path_factory):
    """The pipeline's own target on the tiny model: 32 sequences per rank per step, a checkpoint
    every 10 steps, long enough that the 1-worker group still trains when the node is back."""
    workdir = tmp_path_factory.mktemp("two-hosts")
    seed_hardware(prepared, workdir, "testbox")
    config = tiny_config({"ddp": {"experiments": [{"world_size": 1}]}}, machine="testbox",
                         two_hosts={"bandwidth_mbit": None,
                                    "experiment": {"micro_batch": 32, "steps": 300, "checkpoint_every": 10}})
    config["data"]["tokenizer"] = str(prepared / "tokenizer")
    config["model"]["path"] = str(prepared / "model")
    snakemake(workdir, "--cores", "2", "two_hosts", config=config, timeout=1200)
    folder = workdir / "results" / "testbox" / "two-hosts"
    return folder, read_run_record(folder / "metrics.json").to_dict(), json.loads((folder / "hosts.json").read_text())


@pytest.mark.slow
def test_a_ray_train_run_across_two_namespaced_hosts_survives_the_worker_node_leaving_and_rejoining(two_hosts):
    folder, metrics, hosts = two_hosts
    ray = metrics["ray"]
    assert metrics["status"] == "ok" and ray["cluster"] == {"mode": "existing cluster", "address_from": "ray.address",
                                                           "head_host": "home-pc"}
    assert [(c["from"], c["to"]) for c in ray["world_size_changes"]] == [(2, 1), (1, 2)], ray["world_size_changes"]
    # Each rank's host by the run's own names: the ray block holds no node address.
    groups = [sorted(r["host"] for r in a["ranks"]) for a in ray["attempts"]]
    assert groups == [["cloud-box", "home-pc"], ["home-pc"], ["cloud-box", "home-pc"]]
    assert "10.77.0." not in json.dumps(ray)
    assert len(metrics["loss"]["per_step"]) == 300 and None not in metrics["loss"]["per_step"]
    assert [e["event"] for e in hosts["events"]][2:5] == ["node left", "node rejoined", "group grew back"]
    assert all(h["tx_bytes"] > 0 and h["rx_bytes"] > 0 for h in hosts["link"]["per_host"])  # both hosts talked
    card = (folder / "README.md").read_text()
    assert card.count("**passed**") == 2 and "cloud-box (10.77.0.2)" in card


@pytest.mark.slow
def test_the_two_hosts_namespaces_and_nodes_are_gone_after_the_run(two_hosts):
    _, _, hosts = two_hosts
    assert set(hosts["namespaces"]) == {"switch", "host0", "host1"}
    for namespace in hosts["namespaces"].values():
        assert links.processes_in(namespace) == [], namespace
