# Data prep: real text that ships with Python -> BPE tokenizer -> packed Arrow blocks.


rule train_tokenizer:
    output:
        f"{PREP}/tokenizer/tokenizer.json",
    params:
        data=config["data"],
    log:
        f"{PREP}/logs/tokenizer.log",
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/train_tokenizer.py"


rule prepare_data:
    input:
        tokenizer=tokenizer_path(),
    output:
        directory(f"{PREP}/data/seq{{seq_len}}"),
    params:
        data=config["data"],
    log:
        f"{PREP}/logs/data-seq{{seq_len}}.log",
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/prepare_data.py"
