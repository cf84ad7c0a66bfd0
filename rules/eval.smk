# Held-out evaluation of the base model, once per dataset, seq_len and model: every trained run's
# eval loss (computed in its worker on the same tokens) is set beside it.


rule evaluate_base_model:
    input:
        data=f"{PREP}/data/{{dataset}}-seq{{seq_len}}",
        model=model_inputs,
    output:
        f"{PREP}/eval/base-{{dataset}}-seq{{seq_len}}{{model_suffix}}.json",
    log:
        f"{PREP}/logs/eval-base-{{dataset}}-seq{{seq_len}}{{model_suffix}}.log",
    conda:
        "../envs/train.yaml"
    # The cores a rank of the runs it serves gets: on a GPU box it is on the critical path
    # before the first training job, and a single thread made it ~30 s there.
    threads: eval_threads
    resources:
        mem_mb=one_process_model_mem_mb(),
        runtime=15,  # one forward pass over the held-out blocks
    params:
        model_source=model_source,
    script:
        "../scripts/evaluate_base.py"
