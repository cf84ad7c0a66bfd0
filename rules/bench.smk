# Measured, not recited: the collective bandwidth of this machine's links (gloo on CPU
# tensors; NCCL on GPU tensors too where 2+ GPUs exist, else recorded as skipped with the
# reason), nccl-tests' algbw and busbw.


rule collectives:
    output:
        report(
            f"{RESULTS}/{MACHINE}/collectives.json",
            category="Hardware",
            labels={"measurement": "collective bandwidth", "machine": MACHINE},
        ),
    log:
        f"{RESULTS}/{MACHINE}/logs/collectives.log",
    benchmark:
        f"{RESULTS}/{MACHINE}/logs/collectives.benchmark.tsv"
    conda:
        "../envs/train.yaml"
    threads: collectives_plan()["world_size"]
    resources:
        gpu=collectives_plan()["gpus"],
        mem_mb=collectives_mem_mb(),
        runtime=15,  # a few iterations per message size and op: minutes
    params:
        plan=collectives_plan(),
        machine=MACHINE,
    script:
        "../scripts/collectives.py"
