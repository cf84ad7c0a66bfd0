"""Ray settings: bad ones stop the workflow with the field named; the card reads records."""
from __future__ import annotations

import json

import pytest

from conftest import resolve, tiny_config
from distlab.configuration.config import ConfigError, load


@pytest.mark.parametrize("overrides, field", [
    ({"world_size": 2, "launcher": "ray", "ray": {"min_workers": 3}}, "ray.min_workers"),
    ({"world_size": 2, "launcher": "ray", "ray": {"max_failures": 2}}, "checkpoint_every"),
    ({"world_size": 2, "launcher": "ray", "ray": {"min_workers": 1}}, "checkpoint_every"),
    ({"world_size": 2, "ray": {"max_failures": 1}}, "ray"),
    ({"world_size": 2, "launcher": "ray", "strategy": "pp"}, "launcher"),
    ({"world_size": 2, "launcher": "ray", "ray": {"resize_interval_s": -1}}, "ray.resize_interval_s"),
])
def test_bad_ray_settings_name_the_config_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"stages\.ray\.experiments(\[0\]|\.0)\.{field}"):
        resolve(overrides, stage="ray")


def test_the_cluster_wide_ray_block_fills_what_an_experiment_leaves_unset():
    cfg = tiny_config({"ray": {"experiments": [{"world_size": 2, "launcher": "ray"},
                                               {"world_size": 2, "launcher": "ray", "tag": "own",
                                                "ray": {"address": "10.0.0.5:6379"}}]}},
                      ray={"address": "env", "storage_path": "s3://bucket/distlab"})
    _, specs = load(cfg, gpu_count=0)
    inherited = specs["ddp-full-w2-mb4-ga1-ray"]["ray"]
    assert (inherited["address"], inherited["storage_path"]) == ("env", "s3://bucket/distlab")
    assert specs["ddp-full-w2-mb4-ga1-ray-own"]["ray"]["address"] == "10.0.0.5:6379"


def _run(launcher, median, **ray):
    spec = resolve({"world_size": 2, "launcher": launcher}, stage="ray" if launcher == "ray" else "ddp")
    from card_runs import from_metrics

    run = {"machine": "box", "experiment": spec["id"], "stage": spec["stage"], "status": "ok", "spec": spec,
           "loss": {"per_step": [2.0, 1.0]},
           "as_built": {"backend": "gloo", "outer_wrapper": "DistributedDataParallel", "world_size": 2},
           "timing": {"step_time_s": {"median": median, "p25": median, "p75": median, "n": 4}}}
    if launcher == "ray":
        run["ray"] = {"world_size": 2, "distinct_nodes": 1, "cluster": {"mode": "local"}, "restarts": 0,
                      "world_size_changes": [], "faults_injected": [], "ranks": [], "attempts": [], **ray}
    return from_metrics(run, folder=f"/nonexistent/box/{spec['id']}")


def test_ray_card_sets_ray_beside_its_torchrun_twin_and_counts_only_recorded_events():
    from distlab.report.cards.stage5_ray import build

    card = build([_run("ray", 0.104), _run("torchrun", 0.100)])
    goals = {g.text.split(" (")[0]: g.status for g in card.goals}
    assert goals["Distributed run on a local Ray cluster"] == "passed"
    assert goals["Elastic resize observed"] == "not run" and goals["Fault recovered"] == "not run"
    assert goals["KubeRay manifest written and checked"] == "not run"
    (table,) = card.tables
    assert table.frame.iloc[0]["step overhead"] == "+4.0%"
    assert any("not met" in note for note in card.notes)

    resized = _run("ray", 0.1, restarts=1, world_size_changes=[{"step": 4, "from": 2, "to": 1}],
                   attempts=[{"start_step": 0, "world_size": 2}, {"start_step": 4, "world_size": 1}])
    goals = {g.text.split(" (")[0]: g.status for g in build([resized]).goals}
    assert goals["Elastic resize observed"] == "passed" and goals["Fault recovered"] == "not run"


def test_ray_records_name_each_ranks_host_by_a_label_the_driver_gives_never_by_its_address():
    from distlab.launchers.ray_record import attempts_from_events, host_labels, labelled

    nodes = [{"node_id": "b", "node_ip": "192.168.1.7", "head": False}, {"node_id": "a", "node_ip": "10.1.2.3",
                                                                         "head": True}]
    events = [{"event": "rank_started", "time": t, "rank": r, "world_size": 2, "start_step": 0, "resumed": False,
               "node_id": n, "node_ip": ip, "pid": 100 + r}
              for t, r, n, ip in [(2, 1, "c", "172.16.0.9"), (1, 0, "a", "10.1.2.3")]]
    labels = host_labels(nodes, events)
    assert labels == {"10.1.2.3": "host-1", "192.168.1.7": "host-2", "172.16.0.9": "host-3"}  # the head's first
    (attempt,) = attempts_from_events([labelled(e, labels) for e in events])
    assert [(r["rank"], r["node_id"], r["host"]) for r in attempt["ranks"]] == [(0, "a", "host-1"), (1, "c", "host-3")]
    assert "node_ip" not in json.dumps(attempt) and "10.1.2.3" not in json.dumps(attempt)
    named = host_labels(nodes, events, {"10.1.2.3": "home-pc", "192.168.1.7": "cloud-box"})
    assert named == {"10.1.2.3": "home-pc", "192.168.1.7": "cloud-box", "172.16.0.9": "host-3"}
