"""Data prep promises: real text, deterministic tokens, a tokenizer transformers can load."""
import json

import torch

from distlab.data_prep import data


def _prepare(root, vocab=512, seq=32):
    cfg = {"source": "python-docs", "vocab_size": vocab, "eval_fraction": 0.05, "seed": 0}
    texts = data.corpus_texts(cfg)
    tok = data.train_tokenizer(texts, vocab, root / "tok")
    data.build_dataset(texts, tok, seq, 0.05, 0, root / "data")
    return root


def test_same_config_gives_the_same_tokens_in_the_same_order(tmp_path):
    a = _prepare(tmp_path / "a")
    b = _prepare(tmp_path / "b")
    assert (a / "tok" / "tokenizer.json").read_bytes() == (b / "tok" / "tokenizer.json").read_bytes()
    for split in ("train", "eval"):
        assert torch.equal(data.load_blocks(a / "data", split)[:], data.load_blocks(b / "data", split)[:])


def test_default_corpus_is_pythons_own_documentation():
    texts = data.corpus_texts({"source": "python-docs"})
    joined = "".join(texts)
    assert len(joined) > 100_000 and "for" in joined and "lambda" in joined


def test_tokenizer_loads_through_transformers_and_round_trips_text(prepared):
    tok = data.load_tokenizer(prepared / "tokenizer")
    text = "def f(x):\n    return x ** 2  # squares"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id is not None and len(tok) == 512


def test_blocks_are_fixed_length_and_train_eval_split_is_disjoint(prepared):
    train = data.load_blocks(prepared / "data32", "train")[:]
    evals = data.load_blocks(prepared / "data32", "eval")[:]
    assert train.shape[1] == evals.shape[1] == 32 and train.dtype == torch.int64
    import datasets

    saved = datasets.load_from_disk(str(prepared / "data32"))
    train_pos, eval_pos = set(saved["train"]["block"]), set(saved["eval"]["block"])
    assert not train_pos & eval_pos
    assert train_pos | eval_pos == set(range(len(train) + len(evals)))  # every packed block is used once


def test_local_jsonl_files_are_read_by_text_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"line {i}"}) for i in range(3)))
    assert data.corpus_texts({"source": "files", "files": [str(path)], "text_field": "body"}) == [
        "line 0", "line 1", "line 2"]


def test_data_prep_reports_rows_tokens_and_tokens_per_second(prepared, capsys):
    from distlab.data_prep.prep_progress import TokenizeProgress

    prep = data.read_data_info(prepared / "data32")["prep"]
    blocks = prep["blocks"]
    assert prep["rows"] > 0 and prep["tokens"] >= blocks * 32 > 0 and prep["tokens_per_s"] > 0
    # While it runs: rows, tokens and the rate, every `every_s` seconds, from each tokenizing process.
    progress = TokenizeProgress(lambda batch: {"input_ids": [[1, 2, 3]] * len(batch["text"])}, every_s=0)
    progress({"text": ["a", "b"]})
    progress({"text": ["c"]})
    assert "tokenized 3 rows, 9 tokens" in capsys.readouterr().out
