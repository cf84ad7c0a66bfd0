"""KubeRay manifests for the Ray stage: a RayCluster (apiVersion ray.io/v1) sized from the
config's `kubernetes:` block, and a RayJob that runs this pipeline's Ray experiments on it.

The RayJob's entrypoint is Snakemake itself with profiles/ray-head: Ray sets RAY_ADDRESS
for a job's entrypoint, and that profile points every `launcher: ray` experiment at it.
Head and workers mount one volume claim at the same path, so the prepared data, the base
model and the run folders are where every rank looks for them.

No open door: Ray token auth is on (`authOptions: {mode: token, secretName: <auth_secret>}`,
the Secret's key auth_token; KubeRay >= 1.5.1 sets RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray
container and on the RayJob submitter, ray-operator/controllers/ray/common/pod.go and
rayjob_controller.go at v1.7.0). The head's dashboard listens on 127.0.0.1 only, and the
RayJob submits in SidecarMode: its submitter is a container of the head pod and calls
http://127.0.0.1:<dashboard port> (common/job.go, BuildJobSubmitCommand), so nothing outside
the pod needs the dashboard.

Light on purpose (no Ray, no torch): it runs in a Snakemake rule and in the tests.
"""
from __future__ import annotations

import copy
import re
import shlex

from distlab.tools.kuberay_crd import KUBERAY_VERSION, crd_errors

API_VERSION = "ray.io/v1"
# The pod templates (the bulk of a RayCluster) are checked against Kubernetes' own OpenAPI
# schema for PodTemplateSpec, as packaged by kubernetes-validate, strict (unknown fields fail).
KUBERNETES_VERSION = "1.33"
# What check() proves, said wherever its verdict is shown (the KubeRay goal's title).
CHECKED_AGAINST = (f"KubeRay {KUBERAY_VERSION}'s own RayCluster/RayJob CRD schemas (vendored, strict: an unknown "
                   f"field or a wrong type fails) and the Kubernetes v{KUBERNETES_VERSION} PodTemplateSpec schema "
                   "(kubernetes-validate, strict), plus token auth, the submitter's route to the dashboard and "
                   "the fit of every Ray experiment")
SUBMISSION_MODE = "SidecarMode"
# Submission modes whose submitter reaches the dashboard through the head's Service (another
# pod, or the operator): they need a dashboard that listens beyond 127.0.0.1.
REMOTE_SUBMITTERS = ("K8sJobMode", "HTTPMode")
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")


def ray_specs(specs: dict[str, dict]) -> list[dict]:
    return [s for s in specs.values() if s["launcher"] == "ray"]


def _resources(cpu, memory, gpus: int = 0) -> dict:
    amounts = {"cpu": str(cpu), "memory": str(memory)}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(kube: dict, name: str, cpu, memory, gpus: int = 0) -> dict:
    container = {"name": name, "image": kube["image"], "imagePullPolicy": "IfNotPresent",
                 "resources": _resources(cpu, memory, gpus),
                 "env": [{"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]}
    if kube["volume_claim"]:
        container["volumeMounts"] = [{"name": "distlab-work", "mountPath": kube["workdir"]}]
    return container


def _pod(kube: dict, container: dict) -> dict:
    spec = {"containers": [container]}
    if kube["volume_claim"]:
        spec["volumes"] = [{"name": "distlab-work", "persistentVolumeClaim": {"claimName": kube["volume_claim"]}}]
    return {"spec": spec}


def raycluster_spec(kube: dict, ray_version: str) -> dict:
    """The `spec` shared by the RayCluster and the RayJob's rayClusterSpec."""
    head, workers = kube["head"], kube["workers"]
    head_container = _container(kube, "ray-head", head["cpu"], head["memory"])
    head_container["ports"] = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 10001, "name": "client"}]
    worker_container = _container(kube, "ray-worker", workers["cpu"], workers["memory"], workers["gpus"])
    worker_params = {"num-cpus": str(workers["cpu"])}
    if workers["gpus"]:
        worker_params["num-gpus"] = str(workers["gpus"])
    return {
        "rayVersion": ray_version,
        "authOptions": {"mode": "token", "secretName": kube["auth_secret"]},
        # The head schedules no training: ranks go to the worker group only.
        "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "127.0.0.1"},
                          "template": _pod(kube, head_container)},
        "workerGroupSpecs": [{
            "groupName": "trainers",
            "replicas": workers["replicas"],
            "minReplicas": workers["min_replicas"],
            "maxReplicas": workers["max_replicas"],
            "rayStartParams": worker_params,
            "template": _pod(kube, worker_container),
        }],
    }


def raycluster(kube: dict, ray_version: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": "RayCluster",
            "metadata": {"name": kube["name"], "namespace": kube["namespace"], "labels": {"app": "distlab"}},
            "spec": raycluster_spec(kube, ray_version)}


def entrypoint(kube: dict, specs: dict[str, dict], results_dir: str) -> str:
    """Snakemake with the ray-head profile, asked for exactly the Ray experiments' metrics."""
    machine = kube["machine"]
    targets = [f"{results_dir}/{machine}/{s['id']}/metrics.json" for s in ray_specs(specs)]
    command = ["snakemake", "--profile", "profiles/ray-head", "--config", f"machine={machine}", "--", *targets]
    return f"cd {shlex.quote(kube['workdir'])} && " + " ".join(shlex.quote(c) for c in command)


def rayjob(kube: dict, specs: dict[str, dict], ray_version: str, results_dir: str) -> dict:
    """A RayJob that brings up its own cluster (same spec as the RayCluster), runs the
    pipeline's Ray experiments and tears the cluster down when they finish."""
    return {"apiVersion": API_VERSION, "kind": "RayJob",
            "metadata": {"name": f"{kube['name']}-train", "namespace": kube["namespace"],
                         "labels": {"app": "distlab"}},
            "spec": {"entrypoint": entrypoint(kube, specs, results_dir),
                     "submissionMode": SUBMISSION_MODE,  # the submitter reaches the dashboard on 127.0.0.1
                     "shutdownAfterJobFinishes": True,
                     "ttlSecondsAfterFinished": 600,
                     "rayClusterSpec": copy.deepcopy(raycluster_spec(kube, ray_version))}}


def _worker_group(manifest: dict) -> dict:
    spec = manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]
    return spec["workerGroupSpecs"][0]


def _ray_containers(cluster: dict) -> list[dict]:
    templates = [cluster["headGroupSpec"].get("template", {})] + [g.get("template", {})
                                                                  for g in cluster.get("workerGroupSpecs", [])]
    return [t.get("spec", {}).get("containers", [{}])[0] for t in templates]


def token_auth(cluster: dict) -> tuple[bool, str]:
    """Ray token auth on: KubeRay's authOptions with a Secret, or every Ray container given
    RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret by hand."""
    options = cluster.get("authOptions") or {}
    if options.get("mode") == "token":
        secret = options.get("secretName")
        return True, (f"authOptions mode token, token from Secret {secret!r} (key auth_token)" if secret else
                      "authOptions mode token, token in a Secret KubeRay generates")
    unguarded = []
    for container in _ray_containers(cluster):
        env = {e.get("name"): e for e in container.get("env", [])}
        by_secret = (env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom", {}).get("secretKeyRef")
        if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token" or not by_secret:
            unguarded.append(container.get("name", "?"))
    if unguarded:
        return False, (f"no Ray token auth for {unguarded}: anyone who reaches the cluster's ports runs code on it; "
                       "set authOptions {mode: token, secretName: ...}")
    return True, "every Ray container has RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret"


def submitter_route(job_spec: dict, cluster: dict) -> tuple[bool, str]:
    """A RayJob's submitter can reach the dashboard it submits to."""
    mode = job_spec.get("submissionMode", "K8sJobMode")  # the CRD's default
    host = cluster["headGroupSpec"].get("rayStartParams", {}).get("dashboard-host", "localhost")
    loopback = host in ("127.0.0.1", "localhost", "::1")
    if mode in REMOTE_SUBMITTERS and loopback:
        return False, (f"submissionMode {mode} submits from outside the head pod, but the dashboard listens on "
                       f"{host} only; use SidecarMode (the submitter shares the head pod's network)")
    return True, (f"submissionMode {mode}: the submitter shares the head pod's network and reaches the dashboard on "
                  f"{host}" if mode == "SidecarMode" else f"submissionMode {mode}, dashboard-host {host}")


def pod_template_errors(template: dict) -> str | None:
    """Kubernetes' verdict on one pod template: None when its schema accepts it."""
    import kubernetes_validate

    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "distlab-check"},
               "template": template}
    try:
        kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(str(p) for p in error.path if p != "template") or "template"
        return f"{path}: {error.message}"
    return None


def check(manifest: dict, specs: dict[str, dict]) -> dict[str, dict]:
    """Named checks, each {status: passed|failed, detail}: required fields, names and
    quantities Kubernetes accepts, each pod template against Kubernetes' schema, and GPU/CPU
    counts that fit every Ray experiment."""
    checks: dict[str, dict] = {}

    def record(name, ok, detail):
        checks[name] = {"status": "passed" if ok else "failed", "detail": detail}

    kind = manifest.get("kind")
    record("api_version", manifest.get("apiVersion") == API_VERSION, f"apiVersion {manifest.get('apiVersion')!r}")
    name = manifest.get("metadata", {}).get("name", "")
    record("name", bool(K8S_NAME.match(name)) and len(name) <= 63, f"metadata.name {name!r} (RFC 1123 label)")
    cluster = manifest.get("spec", {}) if kind == "RayCluster" else manifest.get("spec", {}).get("rayClusterSpec", {})
    required = ["rayVersion", "headGroupSpec", "workerGroupSpecs"]
    missing = [k for k in required if k not in cluster]
    record("required_fields", not missing, f"missing {missing}" if missing else f"{kind} has {required}")
    if missing:
        return checks
    problems = crd_errors(manifest)
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    record("crd_schema", not problems, "; ".join(problems[:5]) + more if problems else
           f"accepted by KubeRay {KUBERAY_VERSION}'s {kind} CRD schema (strict)")
    record("token_auth", *token_auth(cluster))
    if kind == "RayJob":
        record("entrypoint", "profiles/ray-head" in manifest["spec"].get("entrypoint", ""),
               "the entrypoint runs snakemake with profiles/ray-head")
        record("submitter_reaches_dashboard", *submitter_route(manifest["spec"], cluster))
    group = _worker_group(manifest)
    for role, template in (("head", cluster["headGroupSpec"].get("template", {})),
                           (group.get("groupName", "workers"), group.get("template", {}))):
        error = pod_template_errors(template)
        record(f"pod_template:{role}", error is None,
               error or f"accepted by the Kubernetes v{KUBERNETES_VERSION} PodTemplateSpec schema (strict)")
    low, count, high = group["minReplicas"], group["replicas"], group["maxReplicas"]
    record("replicas", 0 <= low <= count <= high, f"minReplicas {low} <= replicas {count} <= maxReplicas {high}")
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0],
                  group["template"]["spec"]["containers"][0]]
    bad = [f"{c['name']}.{k}={v}" for c in containers for k, v in c["resources"]["limits"].items()
           if not QUANTITY.match(v)]
    record("quantities", not bad, f"not Kubernetes quantities: {bad}" if bad
           else "cpu, memory and GPU quantities parse")
    worker = containers[1]
    gpus = int(worker["resources"]["limits"].get("nvidia.com/gpu", 0))
    record("gpu_request_matches_ray", str(gpus or "") == group["rayStartParams"].get("num-gpus", ""),
           f"the pod asks Kubernetes for {gpus} GPU(s) and tells Ray num-gpus "
           f"{group['rayStartParams'].get('num-gpus', 0)}")
    cpus = float(group["rayStartParams"]["num-cpus"])
    for spec in ray_specs(specs):
        if spec.device == "cuda":
            slots, unit = high * gpus, "GPUs"
        else:
            slots = high * int(cpus // spec.cpu_threads_per_rank)
            unit = f"CPU slots of {spec.cpu_threads_per_rank} cores"
        needed = spec.ray["min_workers"] or spec.world_size
        ok = spec.world_size <= slots and (spec.device != "cuda" or gpus > 0)
        record(f"fits:{spec.id}", ok,
               f"{spec.world_size} ranks on {spec.device} (at least {needed}); the workers offer {slots} {unit} "
               f"at maxReplicas {high}")
    return checks
