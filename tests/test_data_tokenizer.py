"""Promises about which tokenizer encodes the data: a model brought as a folder is fed with
its own tokenizer, and a tokenizer that does not fit the model is refused before any job."""
import json
import shutil

import pytest

from conftest import snakemake, tiny_config

CORPUS = [f"Row {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(400)]


def _own_tokenizer(out_dir, vocab_size=300, specials=("<s>", "</s>", "<pad>")):
    """A BPE of the model's own, trained on other text with other special tokens than the one
    distlab trains (so ids from the wrong tokenizer would show)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Lorem ipsum dolor sit amet, consectetur adipiscing elit."] * 50 + CORPUS[:20],
                            trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                      pad_token=specials[2])
    wrapped.save_pretrained(str(out_dir))
    return wrapped


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    """A tiny GPT-2 model folder exactly as a download looks: config.json, safetensors, tokenizer."""
    from transformers import AutoModelForCausalLM, GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    tok = _own_tokenizer(folder)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


def _config(model_dir, corpus, **data):
    cfg = tiny_config({"ddp": {"experiments": [{"strategy": "ddp"}]}})
    cfg["model"]["path"] = str(model_dir)
    cfg["data"] = {"source": "files", "files": [str(corpus)], **data}
    return cfg


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.slow
def test_model_folder_data_is_encoded_with_the_models_own_tokenizer(tmp_path, gpt2_folder):
    from transformers import AutoTokenizer

    import datasets

    corpus = _jsonl(tmp_path / "corpus.json", CORPUS)  # JSON lines in a .json file: rows, not one document
    snakemake(tmp_path, "--cores", "2", "results/prep/data/default-seq32", config=_config(gpt2_folder, corpus))
    assert not (tmp_path / "results/prep/tokenizer").exists()  # no second tokenizer trained
    saved = datasets.load_from_disk(str(tmp_path / "results/prep/data/default-seq32"))
    blocks = sorted((row["block"], row["input_ids"]) for split in saved.values() for row in split)
    stream = [i for _, ids in blocks for i in ids]
    tok = AutoTokenizer.from_pretrained(str(gpt2_folder))
    expected = "".join(t + tok.eos_token for t in CORPUS)
    decoded = tok.decode(stream)
    assert len(decoded) > 0.9 * len(expected) and expected.startswith(decoded)  # only the tail block is cut
    info = json.loads((tmp_path / "results/prep/data/default-seq32/distlab_data.json").read_text())
    assert info["tokenizer"]["vocab_size"] == len(tok) and info["tokenizer"]["eos_token_id"] == tok.eos_token_id
    import hashlib

    assert info["tokenizer"]["source_tokenizer_json_sha256"] == hashlib.sha256(
        (gpt2_folder / "tokenizer.json").read_bytes()).hexdigest()


def test_tokenizer_with_more_ids_than_the_model_embeds_is_refused(tmp_path, gpt2_folder):
    from distlab.configuration.config import ConfigError, load

    _own_tokenizer(tmp_path / "big", vocab_size=600)
    corpus = _jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    with pytest.raises(ConfigError, match=r"ids up to \d+ .*config\.json has vocab_size 300"):
        load(_config(gpt2_folder, corpus, tokenizer=str(tmp_path / "big")), gpu_count=0)


def test_tokenizer_whose_eos_differs_from_the_models_is_refused_naming_both(tmp_path, gpt2_folder):
    from distlab.configuration.config import ConfigError, load

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(gpt2_folder / "tokenizer.json", other)
    declared = json.loads((gpt2_folder / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**declared, "eos_token": "<pad>"}))  # id 2, model: 1
    corpus = _jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    with pytest.raises(ConfigError, match=r"eos_token_id 2 but the model's .*config\.json says eos_token_id 1"):
        load(_config(gpt2_folder, corpus, tokenizer=str(other)), gpu_count=0)


def test_bare_tokenizer_json_takes_its_special_tokens_from_the_model(tmp_path, gpt2_folder):
    from distlab.data_prep import data
    from distlab.configuration.config import load

    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    shutil.copy(gpt2_folder / "tokenizer.json", bare)
    corpus = _jsonl(tmp_path / "c.jsonl", CORPUS[:5])
    load(_config(gpt2_folder, corpus, tokenizer=str(bare)), gpu_count=0)  # accepted at config time
    tok = data.load_tokenizer(bare, gpt2_folder / "config.json")
    model_cfg = json.loads((gpt2_folder / "config.json").read_text())
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        model_cfg["eos_token_id"], model_cfg["bos_token_id"], model_cfg["pad_token_id"])


def test_bare_tokenizer_json_without_any_eos_is_refused(tmp_path):
    from distlab.configuration.config import ConfigError, load

    _own_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    cfg = tiny_config({"ddp": {"experiments": [{"strategy": "ddp"}]}})
    cfg["data"]["tokenizer"] = str(tmp_path / "tok" / "tokenizer.json")  # the built model: no config ids
    with pytest.raises(ConfigError, match="names no EOS token"):
        load(cfg, gpu_count=0)


def test_streamed_txt_with_a_space_marking_tokenizer_is_refused_before_any_job(tmp_path):
    """SentencePiece-style tokenizers prepend a space marker to every call, so a .txt file
    streamed in pieces would train on other ids than the document's: refused at config time,
    naming the file's field; JSON lines with the same tokenizer, and .txt with a byte-level
    one, are accepted."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from distlab.configuration.config import ConfigError, load

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(prepend_scheme="always"), decoders.Metaspace()
    tok.train_from_iterator(CORPUS[:50], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                             show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(
        str(tmp_path / "sp"))
    _own_tokenizer(tmp_path / "bytes")
    book = tmp_path / "book.txt"
    book.write_text("\n".join(CORPUS[:40]) + "\n")

    def config(tokenizer, corpus):
        cfg = tiny_config({"ddp": {"experiments": [{"strategy": "ddp"}]}})
        cfg["data"].update(source="files", files=[str(corpus)], tokenizer=str(tmp_path / tokenizer))
        return cfg

    with pytest.raises(ConfigError, match=r"'data\.files\[0\]': a plain-text \(\.txt\) file is streamed"):
        load(config("sp", book), gpu_count=0)
    load(config("sp", _jsonl(tmp_path / "book.jsonl", CORPUS[:40])), gpu_count=0)
    load(config("bytes", book), gpu_count=0)
