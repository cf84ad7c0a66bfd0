# What this machine has, and its measured matmul peak: the denominator of CPU MFU.


rule hardware:
    output:
        f"{RESULTS}/{MACHINE}/hardware.json",
    params:
        machine=config["machine"],
    log:
        f"{RESULTS}/{MACHINE}/logs/hardware.log",
    threads: workflow.cores
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/hardware.py"
