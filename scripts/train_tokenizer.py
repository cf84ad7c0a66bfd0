"""Rule train_tokenizer: byte-level BPE on the configured corpus (for the model the pipeline builds)."""
import os

from distlab.data_prep.data import load_rows, text_batches, train_tokenizer
from distlab.jobs.rule_log import logged

with logged(snakemake):
    data = snakemake.params.data
    rows = load_rows(data)
    print(f"corpus: {len(rows)} documents from {data['source']}")
    tokenizer = train_tokenizer(text_batches(rows, data), data["vocab_size"],
                                os.path.dirname(snakemake.output[0]))
    print(f"tokenizer: {len(tokenizer)} tokens")
