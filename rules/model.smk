# The base model: built once with a fixed seed (unless model.path names a real one).


rule build_base_model:
    input:
        tokenizer=tokenizer_path(),
    output:
        f"{PREP}/model/config.json",
    params:
        build=config["model"]["build"],
    log:
        f"{PREP}/logs/model.log",
    resources:
        mem_mb=one_process_model_mem_mb(),
        runtime=15,  # builds and saves a model: minutes even for the largest preset
    conda:
        "../envs/train.yaml"
    script:
        "../scripts/build_model.py"
