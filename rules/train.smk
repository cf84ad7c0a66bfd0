# One job per experiment: the launcher its spec names starts the ranks of the shared loop.


rule train:
    input:
        # The step-time prediction's measured parts (probe, collectives): read before the ranks start.
        unpack(prediction_inputs),
        data=data_dir,
        model=model_inputs,
        hardware=f"{RESULTS}/{MACHINE}/hardware.json",
        base_eval=base_eval_path,
    output:
        metrics=f"{RUN}/metrics.json",
        steps=f"{RUN}/steps.jsonl",
        checkpoint=directory(f"{RUN}/checkpoint"),
        devices=f"{RUN}/devices.json",
        job=f"{RUN}/job.json",
        # Generated accelerate/deepspeed configs and per-rank records (pipeline-rank<r>.json)
        # the report reads: one declared folder (distlab/records/run_layout.py).
        run_files=directory(f"{RUN}/{RUN_FILES}"),
    params:
        spec=experiment_spec,
        model_source=model_source,
        env_allowlist=config["env_allowlist"],
    log:
        f"{RUN}/train.log",
    benchmark:
        f"{RUN}/benchmark.tsv"
    threads: experiment_threads
    resources:
        gpu=experiment_gpus,
        mem_mb=experiment_mem_mb,
        runtime=experiment_runtime,
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/train.py"
