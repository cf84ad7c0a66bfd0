"""Rule evaluate_base_model: the base model's loss and perplexity on the held-out eval tokens, in a
process of its own (distlab.launchers.call: on CPU it starts warm, as ranks do)."""
import json

from distlab.jobs.rule_log import logged
from distlab.launchers.call import call_in_own_process

with logged(snakemake):
    out = snakemake.output[0]
    call_in_own_process("distlab.runtime.evaluation:evaluate_base", out, model_source=snakemake.params.model_source,
                        data_dir=snakemake.input.data, out_path=out, threads=snakemake.threads)
    result = json.loads(open(out).read())
    print(f"base model eval: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
          f"over {result['tokens']} tokens on {result['threads']} threads")
