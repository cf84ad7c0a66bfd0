# The base model (unless model.path names a real one) and each model.extra entry: built
# once with a fixed seed.


rule build_base_model:
    input:
        tokenizer=tokenizer_path(),
    output:
        f"{PREP}/model{{model_suffix}}/config.json",
    log:
        f"{PREP}/logs/model{{model_suffix}}.log",
    conda:
        "../envs/train.yaml"
    resources:
        mem_mb=one_process_model_mem_mb(),
        runtime=15,  # builds and saves a model: minutes even for the largest preset
    params:
        build=lambda wildcards: model_build(wildcards.model_suffix[1:] or "default"),
    script:
        "../scripts/build_model.py"
