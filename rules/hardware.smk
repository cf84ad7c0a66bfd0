# What this machine has, and its measured matmul peak: the denominator of CPU MFU.


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
