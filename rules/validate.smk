# Checkpoint validation: one job per trained experiment, in processes that did not train.
# Reload, resharding, resume parity, the Hugging Face export, LoRA base weights, size and
# save/load seconds -> validation.json (distlab/jobs/validate.py says how each is measured).


rule validate_checkpoint:
    input:
        metrics=f"{RUN}/metrics.json",
        checkpoint=f"{RUN}/checkpoint",
        data=data_dir,
        model=model_inputs,
    output:
        f"{RUN}/validation.json",
        work=directory(f"{RUN}/validation-work"),  # each launch's job file and raw checks
    log:
        f"{RUN}/validate.log",
    benchmark:
        f"{RUN}/validate-benchmark.tsv"
    conda:
        "../envs/train.yaml"
    threads: validation_threads
    resources:
        gpu=validation_gpus,
        mem_mb=validation_mem_mb,
        runtime=validation_runtime,
    params:
        spec=experiment_spec,
        model_source=model_source,
    script:
        "../scripts/validate.py"
