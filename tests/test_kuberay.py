"""KubeRay promises: a RayCluster and a RayJob for this config's Ray experiments, whose
fields Kubernetes and KubeRay require are there and whose GPUs fit the experiments."""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, snakemake, tiny_config
from distlab.tools import kuberay
from distlab.configuration.config import load

RAY_EXPERIMENTS = [{"world_size": 2, "launcher": "ray"},
                   {"world_size": 2, "launcher": "ray", "device": "cuda", "tag": "gpu"}]


def expanded(experiments=RAY_EXPERIMENTS, **kubernetes):
    cfg = tiny_config({"ddp": {"experiments": [{"world_size": 1}]}, "ray": {"experiments": experiments}})
    cfg["kubernetes"] = kubernetes
    cfg, specs = load(cfg, gpu_count=0)
    return cfg["kubernetes"], specs


def round_trip(manifest: dict) -> dict:
    return yaml.safe_load(yaml.safe_dump(manifest))  # what `kubectl apply -f` reads


def test_raycluster_has_head_and_worker_groups_with_one_gpu_per_rank():
    kube, specs = expanded(workers={"gpus": 1, "replicas": 2, "min_replicas": 1, "max_replicas": 2})
    cluster = round_trip(kuberay.raycluster(kube, "2.60.0"))
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec = cluster["spec"]
    assert spec["rayVersion"] == "2.60.0"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no ranks on the head
    (group,) = spec["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 2, 2)
    container = group["template"]["spec"]["containers"][0]
    assert container["image"] == kube["image"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1" == group["rayStartParams"]["num-gpus"]
    mount = container["volumeMounts"][0]
    assert mount["mountPath"] == kube["workdir"]
    assert group["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == kube["volume_claim"]
    checks = kuberay.check(cluster, specs)
    assert all(c["status"] == "passed" for c in checks.values()), checks
    assert set(checks) >= {"api_version", "required_fields", "replicas", "quantities", "gpu_request_matches_ray",
                           "pod_template:head", "pod_template:trainers", "fits:ddp-full-w2-mb4-ga1-ray-gpu"}


def test_rayjob_runs_exactly_the_ray_experiments_with_the_ray_head_profile():
    kube, specs = expanded()
    job = round_trip(kuberay.rayjob(kube, specs, "2.60.0", "results"))
    assert job["kind"] == "RayJob" and job["spec"]["shutdownAfterJobFinishes"] is True
    entry = job["spec"]["entrypoint"]
    assert "snakemake --profile profiles/ray-head" in entry and f"cd {kube['workdir']}" in entry
    ray_ids = sorted(s["id"] for s in specs.values() if s["launcher"] == "ray")
    assert ray_ids and all(f"results/{kube['machine']}/{i}/metrics.json" in entry for i in ray_ids)
    assert "ddp-full-w1-mb4-ga1/" not in entry  # the torchrun experiment stays off the cluster
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"] == kube["workers"]["max_replicas"]
    assert all(c["status"] == "passed" for c in kuberay.check(job, specs).values())


@pytest.mark.parametrize("workers, failing", [
    ({"gpus": 1, "max_replicas": 1, "min_replicas": 1, "replicas": 1}, "fits:ddp-full-w2-mb4-ga1-ray-gpu"),
    ({"gpus": 0}, "fits:ddp-full-w2-mb4-ga1-ray-gpu"),
    ({"replicas": 3, "max_replicas": 2}, "replicas"),
    ({"memory": "lots"}, "quantities"),
])
def test_manifest_check_fails_when_the_workers_cannot_hold_the_experiments(workers, failing):
    kube, specs = expanded(workers=workers)
    checks = kuberay.check(round_trip(kuberay.raycluster(kube, "2.60.0")), specs)
    assert checks[failing]["status"] == "failed", checks[failing]


@pytest.mark.parametrize("break_it, expected", [
    (lambda c: c["ports"][0].update(containerPort="6379"), "containerPort: '6379' is not of type 'integer'"),
    (lambda c: c.update(volumeMount=c.pop("volumeMounts")), "volumeMount"),  # a typo'd field name
    (lambda c: c.pop("name"), "'name' is a required property"),
])
def test_pod_templates_are_checked_against_the_kubernetes_schema(break_it, expected):
    kube, specs = expanded()
    cluster = round_trip(kuberay.raycluster(kube, "2.60.0"))
    break_it(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    checks = kuberay.check(cluster, specs)
    assert checks["pod_template:head"]["status"] == "failed"
    assert expected in checks["pod_template:head"]["detail"]
    assert checks["pod_template:trainers"]["status"] == "passed"  # the other template is untouched


def test_missing_required_fields_are_reported_not_ignored():
    kube, specs = expanded()
    cluster = round_trip(kuberay.raycluster(kube, "2.60.0"))
    del cluster["spec"]["workerGroupSpecs"]
    assert kuberay.check(cluster, specs)["required_fields"]["status"] == "failed"


@pytest.mark.slow
def test_kuberay_rule_writes_the_manifests_and_their_checks(tmp_path):
    config = tiny_config({"ray": {"experiments": RAY_EXPERIMENTS}})
    snakemake(tmp_path, "--cores", "1", "results/kuberay/checks.json", config=config)
    record = json.loads((tmp_path / "results/kuberay/checks.json").read_text())
    assert record["passed"] and set(record["checks"]) == {"RayCluster", "RayJob"}
    assert "KubeRay v1.7.0's own RayCluster/RayJob CRD schemas (vendored, strict" in record["checked_against"]
    cluster = yaml.safe_load((tmp_path / "results/kuberay/raycluster.yaml").read_text())
    job = yaml.safe_load((tmp_path / "results/kuberay/rayjob.yaml").read_text())
    assert cluster["kind"] == "RayCluster" and job["kind"] == "RayJob"
    assert (REPO / "profiles/ray-head/config.yaml").is_file()


def test_both_manifests_pass_kuberay_s_own_crd_schemas_and_strictly():
    from distlab.tools.kuberay_crd import CRD_DIR

    assert (CRD_DIR / "LICENSE").is_file()
    assert "59d663aeec13760646da3db9c1cf8cfe883e30b7" in (CRD_DIR / "SOURCE.md").read_text()
    kube, specs = expanded()
    for manifest in (kuberay.raycluster(kube, "2.60.0"), kuberay.rayjob(kube, specs, "2.60.0", "results")):
        manifest = round_trip(manifest)
        assert kuberay.check(manifest, specs)["crd_schema"]["status"] == "passed"
        cluster = manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]
        cluster["workerGroupSpecs"][0]["replica"] = 2  # a typo'd field name
        cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # a number where the CRD says string
        detail = kuberay.check(manifest, specs)["crd_schema"]["detail"]
        assert "'replica' was unexpected" in detail and "num-cpus: 0 is not of type 'string'" in detail


def test_a_manifest_without_ray_token_auth_fails_its_check():
    kube, specs = expanded()
    cluster = round_trip(kuberay.raycluster(kube, "2.60.0"))
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": kube["auth_secret"]}
    assert kuberay.check(cluster, specs)["token_auth"]["status"] == "passed"
    del cluster["spec"]["authOptions"]
    assert kuberay.check(cluster, specs)["token_auth"]["status"] == "failed"


def test_the_rayjob_submitter_reaches_a_dashboard_that_listens_on_loopback_only():
    kube, specs = expanded()
    job = round_trip(kuberay.rayjob(kube, specs, "2.60.0", "results"))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    assert head["dashboard-host"] == "127.0.0.1" and job["spec"]["submissionMode"] == "SidecarMode"
    assert kuberay.check(job, specs)["submitter_reaches_dashboard"]["status"] == "passed"
    del job["spec"]["submissionMode"]  # the CRD's default, K8sJobMode: a submitter pod of its own
    assert kuberay.check(job, specs)["submitter_reaches_dashboard"]["status"] == "failed"
