"""data.packing (distlab/data_prep/packing.py): rows packed as documents attend only to themselves
(the model's own mask code reads the restarting position ids, in every family), cover the same
label tokens as one row per sequence, and give the base model the same held-out loss; what
cannot take them is refused at config time naming the field."""
from __future__ import annotations

import json

import pytest

from conftest import tiny_config
from distlab.configuration.config import ConfigError, load
from distlab.testing import build_instruction_data

SEQ = 128  # rows of pydoc-instructions are ~170 tokens: pieces of several rows share a block


@pytest.fixture(scope="module")
def packed(prepared, tmp_path_factory):
    """pydoc-instructions prepared under each packing, every eval block evaluated (eval_blocks
    past the split), and the base model's held-out loss on each (the evaluate_base_model rule's code)."""
    from distlab.runtime.evaluation import evaluate_base

    root = tmp_path_factory.mktemp("packing")
    out = {}
    for mode in ("documents", "none", "blocks"):
        data_dir = build_instruction_data(prepared, root / mode, seq_len=SEQ, packing=mode, eval_blocks=10_000)
        out[mode] = {"dir": data_dir, "info": json.loads((data_dir / "distlab_data.json").read_text()),
                     "eval": evaluate_base(str(prepared / "model"), data_dir, root / f"{mode}.json", threads=1)}
    return out


def test_documents_packing_gives_the_held_out_loss_of_one_row_per_sequence(packed):
    documents, none = packed["documents"], packed["none"]
    # Packed: fewer sequences for the same rows; every eval sequence evaluated under both.
    assert documents["info"]["splits"]["eval"]["blocks"] < none["info"]["splits"]["eval"]["blocks"]
    assert documents["eval"]["blocks"] == documents["info"]["splits"]["eval"]["blocks"]
    assert none["eval"]["blocks"] == none["info"]["splits"]["eval"]["blocks"]
    assert documents["eval"]["tokens"] == none["eval"]["tokens"] > 0
    assert abs(documents["eval"]["loss"] - none["eval"]["loss"]) < 1e-5
    # Rows run into each other under blocks: another held-out loss (so the equality above is not vacuous).
    assert abs(packed["blocks"]["eval"]["loss"] - none["eval"]["loss"]) > 1e-4


def test_documents_and_none_train_on_the_same_label_tokens(packed):
    from distlab.data_prep.data import load_labels, load_positions

    for split in ("train", "eval"):
        assert packed["documents"]["info"]["splits"][split]["trained_tokens"] == \
            packed["none"]["info"]["splits"][split]["trained_tokens"]
    positions = load_positions(packed["documents"]["dir"], "train")[:]
    labels = load_labels(packed["documents"]["dir"], "train")[:]
    restarts = positions[:, 1:] == 0
    assert restarts.any()  # several rows in one block
    assert bool((labels[:, 1:][restarts] == -100).all())  # a row's first token is never predicted from the row before
    assert load_positions(packed["none"]["dir"], "train") is None  # right padding: the default positions


def test_packed_rows_attend_only_to_their_own_row_in_every_family():
    """Two rows packed in one sequence give each row's logits alone (1e-5), in each of the six
    families' own mask code (Mistral's sliding window included)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from distlab.data_prep.packing import packed_inputs
    from test_families import FAMILIES

    for family, (class_name, fields) in FAMILIES.items():
        config = getattr(transformers, class_name)(vocab_size=300, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                   **fields)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        first, second = torch.randint(3, 300, (1, 13)), torch.randint(3, 300, (1, 19))
        positions = torch.cat([torch.arange(13), torch.arange(19)])[None]
        with torch.no_grad():
            alone = torch.cat([model(input_ids=first).logits, model(input_ids=second).logits], 1)
            together = model(input_ids=torch.cat([first, second], 1), **packed_inputs(positions)).logits
        assert (together - alone).abs().max().item() < 1e-5, family


def config_with(data: dict, experiment: dict) -> dict:
    cfg = tiny_config({"parallel": {"experiments": [experiment]}})
    cfg["data"].update(data)
    return cfg


@pytest.mark.parametrize("data, experiment, field, words", [
    ({"packing": "documents"}, {"strategy": "ddp"}, "data.packing", "text is packed as blocks"),
    ({"extra": {"sft": {"source": "python-docs-instructions", "format": "instruction"}}},
     {"strategy": "pp", "world_size": 2, "dataset": "sft"}, "dataset", "pipeline stages"),
])
def test_what_cannot_take_packed_documents_is_refused_naming_the_field(data, experiment, field, words):
    with pytest.raises(ConfigError, match=field) as err:
        load(config_with(data, experiment), gpu_count=0)
    assert words in str(err.value)


def test_pipeline_parallel_takes_instruction_rows_one_per_sequence():
    data = {"extra": {"sft": {"source": "python-docs-instructions", "format": "instruction", "packing": "none"}}}
    _, specs = load(config_with(data, {"strategy": "pp", "world_size": 2, "dataset": "sft"}), gpu_count=0)
    assert len(specs) == 1


@pytest.mark.slow
def test_fine_tuning_card_sets_label_tokens_per_second_of_documents_against_none(prepared, packed, tmp_path):
    """Two real runs on the same rows, packed as documents and one per sequence: the card pairs
    them and shows each one's label tokens per second; documents puts more label tokens in a step."""
    from conftest import resolve, run_experiment
    from distlab.report.cards import PASSED, stage7_finetune

    runs = []
    for mode in ("documents", "none"):
        spec = resolve({"strategy": "ddp", "world_size": 1, "micro_batch": 4, "seq_len": SEQ, "tag": mode},
                       steps=4, untimed_steps=1)
        runs.append(dict(run_experiment(prepared, tmp_path / mode, spec, checkpoint=False,
                                        data_dir=packed[mode]["dir"]), _dir=str(tmp_path / mode)))
    per_step = {run["data_prep"]["packing"]: run["data_prep"]["run_tokens"]["trained"] / 4 for run in runs}
    assert per_step["documents"] > per_step["none"]
    from card_runs import report_run

    card = stage7_finetune.build([report_run(run["_dir"]) for run in runs])
    (goal,) = [g for g in card.goals if g.text == stage7_finetune.GOAL_PACKING]
    assert goal.status == PASSED
    (table,) = [t for t in card.tables if t.title.startswith("Packing")]
    rates = dict(zip(table.frame["packing"], table.frame["label tokens/s"]))
    for run in runs:
        expected = run["data_prep"]["run_tokens"]["trained"] / 4 / run["timing"]["step_time_s"]["median"]
        assert abs(rates[run["data_prep"]["packing"]] - expected) < 0.1
