"""Rule train_tokenizer: byte-level BPE on the configured corpus."""
import os

from distlab.data import corpus_texts, train_tokenizer
from distlab.smk import logged

with logged(snakemake):
    data = snakemake.params.data
    texts = corpus_texts(data)
    print(f"corpus: {len(texts)} documents, {sum(map(len, texts))} characters from {data['source']}")
    tokenizer = train_tokenizer(texts, data["vocab_size"], os.path.dirname(snakemake.output[0]))
    print(f"tokenizer: {len(tokenizer)} tokens")
