# KubeRay: the RayCluster and RayJob manifests of this config's Ray experiments, checked.


rule kuberay:
    output:
        cluster=f"{RESULTS}/kuberay/raycluster.yaml",
        job=f"{RESULTS}/kuberay/rayjob.yaml",
        checks=f"{RESULTS}/kuberay/checks.json",
    params:
        kubernetes=config["kubernetes"],
        ray_specs=ray_experiment_specs(),
    log:
        f"{RESULTS}/logs/kuberay.log",
    resources:
        # Writes two manifests and checks them; no cluster is contacted from here.
        mem_mb=500,
        runtime=5,
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/kuberay.py"
