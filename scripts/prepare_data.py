"""Rule prepare_data: rows -> tokens (+ labels) -> packed seq_len blocks, split, saved as Arrow."""
import os
import shutil

from distlab.data_prep.data import build_dataset, load_rows, load_tokenizer
from distlab.jobs.rule_log import logged
from distlab.records.sharing import portable

with logged(snakemake):
    data = snakemake.params.data
    out_dir = snakemake.output[0]
    tokenizer = load_tokenizer(snakemake.params.tokenizer, snakemake.params.model_config)
    print(f"tokenizer: {portable(snakemake.params.tokenizer)} ({type(tokenizer).__name__}, {len(tokenizer)} tokens, "
          f"eos {tokenizer.eos_token_id})")
    # load_dataset's and map's Arrow caches live in a scratch folder beside the output, removed after.
    cache = out_dir.rstrip("/") + ".cache"
    os.makedirs(cache, exist_ok=True)
    rows = load_rows(data, cache_dir=cache)
    dataset = build_dataset(rows, tokenizer, int(snakemake.wildcards.seq_len), data["eval_fraction"], data["seed"],
                            out_dir, cfg=data, num_proc=snakemake.threads, cache_dir=cache,
                            tokenizer_source=snakemake.params.tokenizer)
    shutil.rmtree(cache, ignore_errors=True)
    print(dataset)
