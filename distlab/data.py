"""Data prep: real text that ships with Python, a BPE tokenizer, fixed-length blocks.

Deterministic by construction: the corpus is read in a sorted order, the tokenizer trains
on it single-threaded, and the train/eval split uses a seeded permutation.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def corpus_texts(data_cfg: dict) -> list[str]:
    source = data_cfg["source"]
    if source == "python-docs":
        # The pydoc topic pages: ~0.5 MB of English prose and code in every CPython install.
        import pydoc_data.topics as topics

        return [topics.topics[key] for key in sorted(topics.topics)]
    if source == "files":
        texts = []
        for name in data_cfg["files"]:
            path = Path(name)
            if path.suffix == ".jsonl":
                with open(path) as fh:
                    for line_no, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        row = json.loads(line)
                        if data_cfg["text_field"] not in row:
                            raise ValueError(f"{path}:{line_no}: no field '{data_cfg['text_field']}' "
                                             "(data.text_field)")
                        texts.append(row[data_cfg["text_field"]])
            else:
                texts.append(path.read_text(encoding="utf-8"))
        return texts
    if source == "hf":
        import datasets

        ds = datasets.load_dataset(data_cfg["hf_name"], split=data_cfg["hf_split"])
        return list(ds[data_cfg["text_field"]])
    raise ValueError(f"data.source: unknown source {source!r}")


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | os.PathLike):
    """Byte-level BPE (the GPT-2/Llama-3 family's scheme) trained with `tokenizers`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: same merges every run
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL_TOKENS[0],
                                      bos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file():  # a bare tokenizer.json
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(str(path))


def pack(texts: list[str], tokenizer, seq_len: int) -> list[list[int]]:
    """Concatenate documents separated by EOS and cut into seq_len blocks (tail dropped)."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    n_blocks = len(stream) // seq_len
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(n_blocks)]


def build_dataset(texts: list[str], tokenizer, seq_len: int, eval_fraction: float, seed: int, out_dir):
    import datasets
    import numpy as np

    blocks = pack(texts, tokenizer, seq_len)
    if len(blocks) < 4:
        raise ValueError(f"only {len(blocks)} blocks of {seq_len} tokens: the corpus is too small for this seq_len")
    order = np.random.default_rng(seed).permutation(len(blocks))
    n_eval = max(1, int(round(len(blocks) * eval_fraction)))
    splits = {"eval": order[:n_eval], "train": np.sort(order[n_eval:])}
    dataset = datasets.DatasetDict({
        # `block` keeps each block's position in the packed stream: provenance for the split.
        name: datasets.Dataset.from_dict({"input_ids": [blocks[i] for i in idx], "block": idx.tolist()})
        for name, idx in splits.items()
    })
    dataset.save_to_disk(str(out_dir))
    return dataset


def load_blocks(path, split: str = "train"):
    """One split's blocks as an int64 tensor [n_blocks, seq_len], from the Arrow dataset."""
    import datasets

    return datasets.load_from_disk(str(path))[split].with_format("torch", columns=["input_ids"])[:]["input_ids"]
