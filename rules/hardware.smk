# What this machine has and can do: its matmul peak (hardware) and the kernels of each run's
# shapes (compute_probe), which a run's step-time prediction reads (rules/common.smk).


rule hardware:
    output:
        f"{RESULTS}/{MACHINE}/hardware.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/hardware.log",
    conda:
        "../envs/train.yaml"
    threads: workflow.cores
    resources:
        # A probe: device queries and a short CPU matmul peak measurement.
        mem_mb=2000,
        runtime=10,
    params:
        machine=config["machine"],
    script:
        "../scripts/hardware.py"


# The compute probe: the kernels of one probe key (device, dtype, threads, micro-batch rows x
# sequence, tensor-parallel degree, 4-bit weights, a ZeRO-3 or FSDP run's sharding wrapper:
# distlab.tools.step_time.probe_key) at one model's shapes, timed for the step-time prediction.
# All cores: it times kernels, so it runs alone, as the hardware rule's peak does. Experiments
# of one key share it.
rule compute_probe:
    input:
        model=lambda wildcards: model_config_path(wildcards.model),
    output:
        f"{RESULTS}/{MACHINE}/compute_probe/{{model}}/{{key}}.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}-{{key}}.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/logs/compute_probe-{{model}}-{{key}}.benchmark.tsv"
    wildcard_constraints:
        key=r"(cpu|cuda)-\w+-t\d+-r\d+x\d+-tp\d+(-nf4)?(-(zero3|zero3lean|fsdp|fsdpkeep))?",
    conda:
        "../envs/train.yaml"
    threads: workflow.cores
    resources:
        # CUDA keys' kernels are timed on one GPU.
        gpu=lambda wildcards: int(wildcards.key.startswith("cuda")),
        mem_mb=one_process_model_mem_mb(),
        runtime=1,  # seconds of kernels after the imports
    script:
        "../scripts/compute_probe.py"
