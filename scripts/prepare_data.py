"""Rule prepare_data: tokenize, pack into seq_len blocks, split, save as Arrow."""
from distlab.data import build_dataset, corpus_texts, load_tokenizer
from distlab.smk import logged

with logged(snakemake):
    data = snakemake.params.data
    tokenizer = load_tokenizer(snakemake.input.tokenizer)
    dataset = build_dataset(corpus_texts(data), tokenizer, int(snakemake.wildcards.seq_len),
                            data["eval_fraction"], data["seed"], snakemake.output[0])
    print(dataset)
