"""Rule kuberay: write the RayCluster and RayJob manifests and the record of their checks."""
import json
import os
from importlib.metadata import version

import yaml

from distlab.tools import kuberay
from distlab.jobs.rule_log import logged

with logged(snakemake):
    kube, specs = snakemake.params.kubernetes, dict(snakemake.params.ray_specs)
    results_dir = os.path.dirname(os.path.dirname(snakemake.output.cluster))  # <results>/kuberay/
    ray_version = version("ray")
    manifests = {"cluster": kuberay.raycluster(kube, ray_version),
                 "job": kuberay.rayjob(kube, specs, ray_version, results_dir)}
    checks = {}
    for key, manifest in manifests.items():
        with open(snakemake.output[key], "w") as fh:
            yaml.safe_dump(manifest, fh, sort_keys=False)
        # Checked as read back from the file: what `kubectl apply -f` would get.
        with open(snakemake.output[key]) as fh:
            checks[manifest["kind"]] = kuberay.check(yaml.safe_load(fh), specs)
    failed = [f"{kind}.{name}: {c['detail']}" for kind, named in checks.items() for name, c in named.items()
              if c["status"] != "passed"]
    record = {"schema_version": 1, "ray_version": ray_version, "passed": not failed, "checks": checks,
              "checked_against": kuberay.CHECKED_AGAINST,
              "experiments": sorted(specs), "files": {k: str(snakemake.output[k]) for k in manifests}}
    with open(snakemake.output.checks, "w") as fh:
        json.dump(record, fh, indent=1)
    for line in failed:
        print(f"check failed: {line}")
