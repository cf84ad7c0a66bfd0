# KubeRay: the RayCluster and RayJob manifests of this config's Ray experiments, checked.


rule kuberay:
    output:
        cluster=f"{RESULTS}/kuberay/raycluster.yaml",
        job=f"{RESULTS}/kuberay/rayjob.yaml",
        checks=f"{RESULTS}/kuberay/checks.json",
    log:
        f"{RESULTS}/logs/kuberay.log",
    conda:
        "../envs/train.yaml"
    resources:
        # Writes two manifests and checks them; no cluster is contacted from here.
        mem_mb=500,
        runtime=5,
    params:
        kubernetes=config["kubernetes"],
        ray_specs=ray_experiment_specs(),
    script:
        "../scripts/kuberay.py"
