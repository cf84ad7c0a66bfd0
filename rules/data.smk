# Data prep: rows (Python's own docs, local files, a hub dataset) -> the model's tokenizer
# (or a BPE trained here for the built model) -> packed Arrow blocks, one folder per
# dataset and seq_len.


rule train_tokenizer:
    output:
        f"{PREP}/tokenizer/tokenizer.json",
    log:
        f"{PREP}/logs/tokenizer.log",
    conda:
        "../envs/train.yaml"
    resources:
        # The corpus and BPE merges in one process: small next to any training job.
        mem_mb=4000,
        runtime=30,
    params:
        data=dataset_config("default"),
    script:
        "../scripts/train_tokenizer.py"


rule prepare_data:
    input:
        tokenizer=tokenizer_inputs(),
        model_config=user_model_config(),
    output:
        directory(f"{PREP}/data/{{dataset}}-seq{{seq_len}}"),
    log:
        f"{PREP}/logs/data-{{dataset}}-seq{{seq_len}}.log",
    conda:
        "../envs/train.yaml"
    threads: 2
    resources:
        # Tokenised blocks of one dataset in one process (written in shards as they fill).
        mem_mb=4000,
        runtime=30,
    params:
        data=lambda wildcards: dataset_config(wildcards.dataset),
        tokenizer=lambda wildcards, input: input.tokenizer[0] if input.tokenizer else tokenizer_path(),
        model_config=lambda wildcards, input: input.model_config[0] if input.model_config else None,
    script:
        "../scripts/prepare_data.py"
