# What this machine has, and its measured matmul peak: the denominator of CPU MFU.


rule hardware:
    output:
        f"{RESULTS}/{MACHINE}/hardware.json",
    params:
        machine=config["machine"],
    log:
        f"{RESULTS}/{MACHINE}/logs/hardware.log",
    threads: workflow.cores
    resources:
        # A probe: device queries and a short CPU matmul peak measurement.
        mem_mb=2000,
        runtime=10,
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/hardware.py"


# The compute probe: the kernels of every predicted experiment on one model, timed at the
# model's shapes and the ranks' thread counts (distlab.tools.compute_probe). All cores: it
# times kernels, so it runs alone, as the hardware rule's peak does.
rule compute_probe:
    input:
        model=lambda wildcards: model_config_path(wildcards.model),
    output:
        f"{RESULTS}/{MACHINE}/compute_probe/{{model}}.json",
    params:
        specs=lambda wildcards: probed_specs(wildcards.model),
    log:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}.benchmark.tsv"
    threads: workflow.cores
    resources:
        # CUDA experiments' kernels are timed on one GPU.
        gpu=lambda wildcards: int(any(spec["device"] == "cuda" for spec in probed_specs(wildcards.model))),
        mem_mb=one_process_model_mem_mb(),
        runtime=10,
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/compute_probe.py"
