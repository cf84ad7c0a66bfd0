"""Every strategy trains in training mode: a model with dropout trains with dropout on.

from_pretrained hands over a model in eval mode; the loop calls Strategy.train_mode() before
the first step (and fails the run if a module stays in eval mode), evaluation runs eval()."""
import json
import shutil

import pytest

from conftest import resolve, run_experiment


@pytest.fixture(scope="module")
def dropout_model(prepared, tmp_path_factory):
    """The tests' tiny model with attention dropout 0.5 (Llama's only dropout)."""
    folder = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(prepared / "model", folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def eval_mode_loss(model_folder, data_dir, samples: list[int]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from distlab.data_prep.data import load_blocks

    model = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32).eval()
    ids = load_blocks(data_dir, "train")[samples]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_dropout_is_active_in_training(prepared, dropout_model, tmp_path):
    workspace = tmp_path / "prepared"
    workspace.mkdir()
    for name in ("data32", "hardware.json"):
        (workspace / name).symlink_to(prepared / name)
    (workspace / "model").symlink_to(dropout_model)
    run = run_experiment(workspace, tmp_path / "run", resolve({"world_size": 1, "micro_batch": 8}, steps=2,
                                                              untimed_steps=1), checkpoint=False)
    assert run["as_built"]["train_mode"]["modules_in_train_mode"] > 0
    first = json.loads((tmp_path / "run" / "steps.jsonl").read_text().splitlines()[0])
    (samples,) = first["samples_by_rank"]
    without_dropout = eval_mode_loss(dropout_model, prepared / "data32", samples)
    # The same weights and samples: only dropout (p=0.5 on attention) can move step 0's loss.
    assert abs(first["loss"] - without_dropout) > 1e-3, (first["loss"], without_dropout)
