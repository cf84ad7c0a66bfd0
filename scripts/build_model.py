"""Rule build_base_model: a seeded Llama-architecture model, written with save_pretrained."""
import os

from distlab.data_prep.data import load_tokenizer
from distlab.runtime.model import build_base_model
from distlab.jobs.rule_log import logged

with logged(snakemake):
    info = build_base_model(snakemake.params.build, load_tokenizer(snakemake.input.tokenizer),
                            os.path.dirname(snakemake.output[0]))
    print(f"built {info['config']['model_type']} with {info['parameters']:,} parameters")
