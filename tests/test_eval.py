"""Promises about held-out evaluation: the base model and every run on the same eval tokens."""
import json

import pytest
from distlab.records.job import Job

from distlab.records.run_outputs import read_run_record
from distlab.records.spec import Spec


def test_base_eval_is_the_models_mean_loss_on_the_first_eval_blocks(prepared, tmp_path):
    import torch

    from distlab.data_prep import data
    from distlab.runtime import evaluation
    from distlab.runtime.model import load_model

    result = evaluation.evaluate_base(str(prepared / "model"), prepared / "data32", tmp_path / "base.json")
    ids = data.load_blocks(prepared / "data32", "eval")[:16]
    model = load_model(prepared / "model")
    with torch.no_grad():  # two equal batches of 8 full blocks: the token mean is the mean of batch means
        expected = sum(model(input_ids=ids[i:i + 8], labels=ids[i:i + 8]).loss.item() for i in (0, 8)) / 2
    assert result["tokens"] == 16 * 31 and abs(result["loss"] - expected) < 1e-5
    assert json.loads((tmp_path / "base.json").read_text())["loss"] == result["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # 16 eval blocks in batches of 6: 3 batches over 2 ranks, so one FSDP rank joins a forward it does not count
    {"strategy": "fsdp", "world_size": 2, "micro_batch": 6},
    {"strategy": "ddp", "world_size": 2, "micro_batch": 3},  # each rank its own whole copy: 3 batches each
])
def test_sharded_run_is_evaluated_whole_beside_the_base_model(prepared, tmp_path, overrides):
    """The worker's eval loss (batches split over the data-parallel ranks) is the exported
    (trained) model's loss on the same tokens, evaluated whole in one process."""
    from transformers import AutoModelForCausalLM

    from conftest import resolve
    from distlab.runtime import evaluation
    from distlab.jobs.launch import launch

    base = evaluation.evaluate_base(str(prepared / "model"), prepared / "data32", tmp_path / "base.json")
    spec = resolve(overrides, stage="fsdp", steps=4, untimed_steps=1)
    run_dir = tmp_path / "run"
    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(prepared / "data32"),
              model_source=str(prepared / "model"), hardware_json=str(prepared / "hardware.json"),
              env_allowlist=[], checkpoint_dir=str(run_dir / "checkpoint"),
              base_eval_json=str(tmp_path / "base.json"))
    launch(job, log_path=str(run_dir / "train.log"), timeout=300)
    metrics = read_run_record(run_dir / "metrics.json").to_dict()
    assert metrics["eval"]["base"]["loss"] == base["loss"]
    trained = metrics["eval"]["trained"]
    exported = AutoModelForCausalLM.from_pretrained(str(run_dir / "checkpoint/final/export"))
    ids, labels = evaluation.eval_tokens(prepared / "data32")
    again = evaluation.evaluate_model(exported, ids, labels)
    assert abs(trained["loss"] - again["loss"]) < 1e-5 and abs(trained["loss"] - base["loss"]) > 1e-4
    assert trained["tokens"] == again["tokens"] and "split over 2 data-parallel ranks" in trained["how"]
    from card_runs import report_run
    from distlab.report.held_out import eval_sentence

    sentence = eval_sentence([report_run(run_dir)])  # the run as the report's door hands it on
    assert f"{base['loss']:.3f} -> {trained['loss']:.3f}" in sentence


def test_summary_gets_each_runs_base_and_trained_eval_loss():
    import pandas as pd

    from card_runs import from_metrics
    from distlab.report.held_out import eval_columns

    runs = [from_metrics({"machine": "m", "experiment": name, "stage": "ddp", "spec": {}, "eval": ev})
            for name, ev in (("a", {"base": {"loss": 8.0}, "trained": {"loss": 7.0, "perplexity": 1096.6}}),
                             ("b", {"base": {"loss": 8.0}, "trained": {"status": "failed"}}))]
    frame = eval_columns(pd.DataFrame([{"machine": "m", "experiment": "b"}, {"machine": "m", "experiment": "a"}]), runs)
    assert frame["eval_loss"].tolist()[1] == 7.0 and pd.isna(frame["eval_loss"].tolist()[0])
    assert frame["eval_loss_base"].tolist() == [8.0, 8.0] and frame["eval_perplexity"].tolist()[1] == 1096.6


def test_an_eval_forward_takes_more_sequences_only_where_their_no_grad_forward_fits_what_training_keeps():
    from types import SimpleNamespace

    from distlab.runtime.evaluation import eval_batch_size

    def llama(v, h, i, a, layers):
        return SimpleNamespace(vocab_size=v, hidden_size=h, intermediate_size=i, num_attention_heads=a,
                               num_hidden_layers=layers)

    budget, default = llama(4096, 768, 2048, 12, 10), llama(4096, 256, 688, 4, 4)
    spec = Spec({"micro_batch": 1, "world_size": 2, "activation_checkpointing": "none"})
    k = eval_batch_size(spec, budget, (16, 128), True)
    assert k == 5  # the stage-3 budget model: 2 forwards a rank instead of 8
    # what k sequences hold without grad <= what one trained sequence keeps for backward
    assert k * 128 * (3 * 4096 + 3 * 2048 + 12 * 128) <= 128 * (2 * 4096 + 10 * (4 * 768 + 3 * 2048))
    assert eval_batch_size(spec.replace(micro_batch=4), default, (16, 128), True) == 4  # default model: unchanged
    assert eval_batch_size(spec.replace(activation_checkpointing="full"), budget, (16, 128), True) == 1
    assert eval_batch_size(spec, budget, (16, 128), False) == 1  # TP / PP ranks split the model
    assert eval_batch_size(spec, SimpleNamespace(vocab_size=4096), (16, 128), True) == 1  # unknown shape
    assert eval_batch_size(spec, budget, (4, 128), True) == 2  # never more than a rank's share
