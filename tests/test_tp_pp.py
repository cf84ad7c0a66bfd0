"""Tensor- and pipeline-parallel promises: same losses as DDP, honest descriptions,
sharded checkpoints that restore, and clear errors for layouts that cannot work."""
from __future__ import annotations

import re

import pytest

from conftest import assert_advisor_estimate_holds, resolve, run_experiment
from distlab.configuration.config import ConfigError
from test_fsdp import (DEFAULTS, FINETUNE, assert_eval_points_end_at_the_final_eval, assert_same_trajectory,
                       ddp_baseline, sharded_checks)

# Every TP/PP rank reads the whole batch: micro_batch 4 x grad_accum 2 = 8 sequences per
# step, the same 8 (in the same order of steps) the 2-rank DDP baseline reads.
WHOLE_BATCH = {"world_size": 2, "micro_batch": 4, "grad_accum": 2, "lr": 1e-3, **FINETUNE}


@pytest.mark.slow
def test_tensor_parallel_matches_ddp_loss_with_attention_and_mlp_split(prepared, tmp_path):
    baseline = ddp_baseline(prepared)
    run = run_experiment(prepared, tmp_path / "tp", resolve({"strategy": "tp", **WHOLE_BATCH,
                                                             "activation_checkpointing": "full", "eval_every": 10},
                                                            stage="parallel", **DEFAULTS), checkpoint=False)
    assert_same_trajectory(run, baseline)  # the norm over split and replicated pieces, every layer recomputed
    assert run["as_built"]["activation_checkpointing"]["checkpointed"] == [0, 1]
    assert_eval_points_end_at_the_final_eval(run)
    as_built = run["as_built"]
    assert as_built["tp_degree"] == 2 and as_built["data_parallel_size"] == 1 and as_built["heads_per_rank"] == 2
    split = as_built["split_linears_per_layer"]
    assert {split[k] for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj",
                               "mlp.gate_proj")} == {"(Shard(dim=0),)"}
    assert split["self_attn.o_proj"] == split["mlp.down_proj"] == "(Shard(dim=1),)"
    # Both ranks read the same samples (data-parallel size 1): that is TP, not a sampler bug.
    assert run["data"]["samples_read_by_every_rank"] == run["data"]["distinct_samples_read"]
    # Each rank holds its split of the plan's linears and the rest whole: the advisor's TP formula.
    assert_advisor_estimate_holds(prepared, run, "tp")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_parallel_matches_ddp_loss_and_measures_its_bubble(prepared, tmp_path, schedule):
    import json

    baseline = ddp_baseline(prepared)
    checkpointing = {"activation_checkpointing": "full", "eval_every": 10} if schedule == "1f1b" else {}
    spec = resolve({"strategy": "pp", **WHOLE_BATCH, "pp": {"schedule": schedule, "microbatches": 2}, **checkpointing},
                   stage="parallel", **DEFAULTS)
    run = run_experiment(prepared, tmp_path / schedule, spec, checkpoint=False)
    assert_same_trajectory(run, baseline)  # the norm summed over both stages' layers
    if checkpointing:  # eval points on the whole model rebuilt on rank 0 from both stages
        assert_eval_points_end_at_the_final_eval(run)
    as_built = run["as_built"]
    assert as_built["schedule"] == {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
    assert [s["layers"] for s in as_built["stages"]] == [[0], [1]]
    assert as_built["bubble_formula"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1), p=2, m=2
    for rank in (0, 1):
        bubble = json.loads((tmp_path / schedule / "run_files" / f"pipeline-rank{rank}.json").read_text())
        assert bubble["idle_fraction"]["n"] == DEFAULTS["steps"] - DEFAULTS["untimed_steps"]
        assert 0 < bubble["idle_fraction"]["median"] < 1
    assert_advisor_estimate_holds(prepared, run, f"pp-{schedule}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_sharded_checkpoint_round_trip_restores_weights_and_optimizer_state(prepared, strategy):
    found = sharded_checks(prepared)[strategy]
    assert found["format"] == "dcp" and found["differed_before_load"]
    assert found["weights_restored"] and found["next_step_identical"] and found["hf_names"]


@pytest.mark.slow
def test_tensor_parallel_verify_fails_when_the_layers_are_not_split(prepared):
    found = sharded_checks(prepared)["tp"]
    assert found["unsplit_model"]["caught"] and re.search("0 linear layers are split|should hold its parameters as "
                                                          "dtensor", found["unsplit_model"]["error"])


@pytest.mark.slow
def test_pipeline_verify_fails_on_a_wrong_schedule_or_a_missing_layer(prepared):
    found = sharded_checks(prepared)["pp"]
    assert found["wrong_schedule"]["caught"] and found["missing_layers"]["caught"]


# -- impossible layouts fail at config time, naming the field ---------------------------------
# The tiny model has 4 heads, 2 key/value heads and 2 decoder layers.
@pytest.mark.parametrize("overrides, field, words", [
    ({"strategy": "tp", "world_size": 4}, "world_size", "num_key_value_heads (2)"),
    ({"strategy": "tp", "world_size": 3}, "world_size", "num_attention_heads (4)"),
    ({"strategy": "pp", "world_size": 3}, "world_size", "needs at least that many decoder layers"),
    ({"strategy": "pp", "world_size": 2, "micro_batch": 6, "pp": {"microbatches": 4}}, "pp.microbatches",
     "micro_batch 6 must divide"),
    ({"strategy": "tp", "world_size": 2, "method": "lora"}, "method", "full fine-tuning only"),
])
def test_impossible_parallel_layouts_are_config_errors_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as error:
        resolve(overrides, stage="parallel")
    assert f"stages.parallel.experiments[0].{field}'" in str(error.value) and words in str(error.value)


def test_pipeline_refuses_tied_embeddings_across_stages():
    from conftest import tiny_config
    from distlab.configuration.config import load

    cfg = tiny_config({"parallel": {"experiments": [{"strategy": "pp", "world_size": 2}]}})
    cfg["model"]["build"]["tie_word_embeddings"] = True
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        load(cfg, gpu_count=0)


def test_layers_split_into_contiguous_balanced_stages():
    from distlab.strategies.pp_stages import bubble_formula, split_layers

    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert [len(r) for r in split_layers(32, 3)] == [11, 11, 10]
    with pytest.raises(ValueError, match="at least 4 decoder layers"):
        split_layers(2, 4)
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
