"""Promises about chat and instruction data: rendered with the tokenizer's own chat template,
and the loss counts only the response/assistant tokens (labels -100 elsewhere)."""
import json

import pytest

from distlab.data_prep import data
from distlab.data_prep.data_formats import IGNORE, encode_chat, encode_instruction
from distlab.records.job import Job
from distlab.records.run_outputs import read_run_record


def _trained_text(tok, ids, labels):
    assert len(ids) == len(labels)
    assert all(l == IGNORE or l == i for i, l in zip(ids, labels))  # a label is the token or masked
    return tok.decode([l for l in labels if l != IGNORE])


def test_instruction_rows_train_only_on_the_response(prepared):
    tok = data.load_tokenizer(prepared / "tokenizer")
    out = encode_instruction({"q": ["What is a list?"], "a": ["A mutable sequence."]}, tok, "q", "a")
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert "What is a list?" in tok.decode(ids)
    assert _trained_text(tok, ids, labels) == "A mutable sequence." + tok.eos_token + "\n"


def test_chat_rows_train_only_on_assistant_turns_of_the_models_template(prepared):
    tok = data.load_tokenizer(prepared / "tokenizer")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say one."},
                {"role": "assistant", "content": "One."}, {"role": "user", "content": "Say two."},
                {"role": "assistant", "content": "Two."}]
    out = encode_chat({"messages": [messages]}, tok, "messages")
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    eos = tok.eos_token
    assert _trained_text(tok, ids, labels) == f"One.{eos}\nTwo.{eos}\n"


def test_instruction_rows_without_a_chat_template_use_the_documented_prompt(prepared):
    tok = data.load_tokenizer(prepared / "tokenizer")
    tok.chat_template = None
    out = encode_instruction({"prompt": ["Add 2 and 2."], "response": ["4"]}, tok, "prompt", "response")
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert tok.decode(ids) == "### Instruction:\nAdd 2 and 2.\n\n### Response:\n4" + tok.eos_token
    assert _trained_text(tok, ids, labels) == "4" + tok.eos_token


@pytest.fixture(scope="module")
def instruction_data(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    cfg = {"source": "python-docs-instructions", "format": "instruction", "prompt_field": "prompt",
           "response_field": "response"}
    tok = data.load_tokenizer(prepared / "tokenizer")
    data.build_dataset(data.load_rows(cfg), tok, 32, 0.1, 0, root / "data32", cfg=cfg,
                       tokenizer_source=prepared / "tokenizer")
    return root / "data32"


def test_prepared_instruction_blocks_carry_masked_labels(instruction_data):
    labels = data.load_labels(instruction_data, "train")[:]
    ids = data.load_blocks(instruction_data, "train")[:]
    assert labels.shape == ids.shape
    masked = (labels == IGNORE)
    assert masked.any() and (~masked).any()
    assert bool(((labels == ids) | masked).all())
    counts = json.loads((instruction_data / "distlab_data.json").read_text())["splits"]["train"]
    assert counts["trained_tokens"] == int((labels[:, 1:] != IGNORE).sum()) and counts["masked_tokens"] > 0


@pytest.mark.slow
def test_training_loss_counts_only_response_tokens(prepared, instruction_data, tmp_path):
    """Step 0's loss is the plain model's loss with the masked labels on the same samples."""
    import torch

    from conftest import resolve
    from distlab.jobs.launch import launch
    from distlab.runtime.model import load_model
    from distlab.data_prep.packing import packed_inputs

    spec = resolve({"strategy": "ddp", "world_size": 1, "micro_batch": 4}, steps=3, untimed_steps=1)
    job = Job(spec=spec, run_dir=str(tmp_path), data_dir=str(instruction_data),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=None)
    launch(job, log_path=str(tmp_path / "train.log"), timeout=300)
    metrics = read_run_record(tmp_path / "metrics.json").to_dict()
    first = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])["samples_by_rank"][0]
    ids = data.load_blocks(instruction_data, "train")[first]
    labels = data.load_labels(instruction_data, "train")[first]
    packed = packed_inputs(data.load_positions(instruction_data, "train")[first])  # rows packed as documents
    model = load_model(prepared / "model")
    with torch.no_grad():
        masked = model(input_ids=ids, labels=labels, **packed).loss.item()
        unmasked = model(input_ids=ids, labels=ids, **packed).loss.item()
    assert abs(metrics["loss"]["first"] - masked) < 1e-5 and abs(masked - unmasked) > 1e-3
    run_tokens = metrics["data_prep"]["run_tokens"]
    assert run_tokens["masked"] > 0 and run_tokens["trained"] > 0
    assert run_tokens["trained"] + run_tokens["masked"] == 3 * 4 * 31
    assert metrics["data_prep"]["format"] == "instruction"
    assert metrics["data_prep"]["tokenizer"]["eos_token_id"] == data.load_tokenizer(prepared / "tokenizer").eos_token_id


def test_a_tokenizer_that_marks_every_call_is_refused_for_streamed_text_pieces():
    import pytest
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from distlab.data_prep.data_formats import DOCUMENT_END, encode_text, pieces_tokenize_like_the_whole

    def fast(pre_tokenizer, decoder):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
        tok.train_from_iterator(["Hello world.\nNext line\nx\ny"] * 20,
                                trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")

    sentencepiece_like = fast(pre_tokenizers.Metaspace(prepend_scheme="always"), decoders.Metaspace())
    byte_level = fast(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    assert pieces_tokenize_like_the_whole(byte_level)
    assert not pieces_tokenize_like_the_whole(sentencepiece_like)
    pieces = {"text": ["Hello world.\n", "Next line"], DOCUMENT_END: [False, True]}
    assert encode_text(pieces, byte_level, "text")["input_ids"][1][-1] == byte_level.eos_token_id
    with pytest.raises(ValueError, match="JSON lines"):
        encode_text(pieces, sentencepiece_like, "text")
    # Whole documents (JSON lines) are fine with either tokenizer.
    assert encode_text({"text": ["Hello world.\nNext line"]}, sentencepiece_like, "text")["input_ids"]
