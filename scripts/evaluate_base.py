"""Rule evaluate_base_model: the base model's loss and perplexity on the held-out eval tokens."""
from distlab.runtime.evaluation import evaluate_base
from distlab.jobs.rule_log import logged

with logged(snakemake):
    result = evaluate_base(snakemake.params.model_source, snakemake.input.data, snakemake.output[0],
                           threads=snakemake.threads)
    print(f"base model eval: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
          f"over {result['tokens']} tokens on {result['threads']} threads")
