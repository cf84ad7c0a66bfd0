"""LoRA promises: targets come from the loaded model, only adapters train, the base weights
stay bit-identical, and data parallelism does not change the result."""
from pathlib import Path

import pytest
import torch

from conftest import assert_advisor_estimate_holds, resolve, run_experiment

LORA = {"method": "lora", "strategy": "ddp"}


def tiny(config_cls, **shape):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config_cls(vocab_size=64, **shape))


def test_default_lora_targets_are_found_from_the_model_not_by_llama_names(prepared):
    from transformers import GPT2Config, Qwen2Config

    from distlab.runtime.lora import lora_targets
    from distlab.runtime.model import load_model

    llama = load_model(prepared / "model")
    assert lora_targets(llama, None) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    qwen = tiny(Qwen2Config, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=48)
    assert "q_proj" in lora_targets(qwen, None) and "lm_head" not in lora_targets(qwen, None)
    # GPT-2 has no nn.Linear in its blocks (transformers' Conv1D): still found.
    gpt2 = tiny(GPT2Config, n_embd=32, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)
    assert lora_targets(gpt2, None) == ["c_attn", "c_fc", "c_proj"]


def test_lora_targets_that_match_no_module_are_refused_naming_the_field(prepared):
    from distlab.runtime.lora import apply_lora
    from distlab.runtime.model import load_model

    with pytest.raises(ValueError, match=r"lora\.target_modules.*c_attn.*q_proj"):
        apply_lora(load_model(prepared / "model"), {"r": 4, "alpha": 8, "dropout": 0.0,
                                                    "target_modules": ["q_proj", "c_attn"]}, seed=0)


def test_an_empty_target_list_is_a_config_error():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"stages\.ddp\.experiments\.0\.lora\.target_modules"):
        resolve({**LORA, "lora": {"target_modules": []}})


def test_lora_makes_only_adapter_weights_trainable(prepared):
    from distlab.runtime.lora import apply_lora, parameter_counts
    from distlab.runtime.model import load_model

    model, targets = apply_lora(load_model(prepared / "model"), {"r": 4, "alpha": 8, "dropout": 0.0,
                                                                 "target_modules": ["q_proj", "v_proj"]}, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert targets == ["q_proj", "v_proj"]
    assert trainable and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trainable)
    counts = parameter_counts(model)
    # Each adapted linear layer gains A (r x in) and B (out x r).
    adapted = [m.base_layer for n, m in model.named_modules() if n.endswith(("q_proj", "v_proj"))]
    assert len(adapted) == 2 * 2  # two targets in each of the tiny model's two layers
    assert counts["trainable"] == sum(4 * (m.in_features + m.out_features) for m in adapted) < counts["total"]


@pytest.fixture(scope="module")
def ddp_lora(prepared, tmp_path_factory):
    """LoRA under DDP: 1 rank x 8 sequences and 2 ranks x 4 (same global batch)."""
    root = tmp_path_factory.mktemp("ddp-lora")
    one = run_experiment(prepared, root / "w1", resolve({**LORA, "world_size": 1, "micro_batch": 8}),
                         checkpoint=False)
    two = run_experiment(prepared, root / "w2", resolve({**LORA, "world_size": 2, "micro_batch": 4}))
    return {"w1": one, "w2": two, "w2_dir": root / "w2"}


def assert_only_adapters_changed(final: Path, prepared: Path, spec: dict) -> None:
    """The checkpoint holds the adapters and nothing else, every one moved from its init, and
    the base model folder + those adapters give the logits recorded from the trained state:
    the base weights did not move."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from distlab.checkpoints.export import eval_batch
    from distlab.runtime.lora import apply_lora
    from distlab.runtime.model import load_model

    state = load_file(final / "state" / "model.safetensors")
    torch.manual_seed(spec["seed"])
    initial, _ = apply_lora(load_model(prepared / "model"), spec["lora"], spec["seed"])
    adapters = {k: v for k, v in initial.state_dict().items() if "lora_" in k}
    assert adapters and set(state) == set(adapters)
    unchanged = [k for k, v in adapters.items() if torch.equal(v, state[k])]
    assert not unchanged, unchanged
    adapted = PeftModel.from_pretrained(load_model(prepared / "model"), str(final / "export")).eval()
    with torch.no_grad():
        logits = adapted(input_ids=eval_batch(prepared / "data32")).logits
    saved = load_file(final / "eval_logits.safetensors")["logits"]
    assert (logits - saved).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_lora_under_ddp_freezes_the_base_weights(prepared, ddp_lora):
    run = ddp_lora["w2"]
    assert run["parameters"]["trainable"] < run["parameters"]["total"]
    assert_only_adapters_changed(ddp_lora["w2_dir"] / "checkpoint" / "final", prepared, run["spec"])


@pytest.mark.slow
def test_lora_under_ddp_two_ranks_matches_one_rank(ddp_lora):
    one, two = ddp_lora["w1"], ddp_lora["w2"]
    assert two["as_built"]["world_size"] == 2 and two["as_built"]["outer_wrapper"] == "DistributedDataParallel"
    assert one["lora_targets"] == two["lora_targets"] and one["parameters"] == two["parameters"]
    assert len(one["loss"]["per_step"]) == len(two["loss"]["per_step"]) == 6
    for a, b in zip(one["loss"]["per_step"], two["loss"]["per_step"]):
        assert abs(a - b) < 1e-4, (one["loss"]["per_step"], two["loss"]["per_step"])
    # The adapters learned something: parity between two real trajectories, not two constants.
    assert one["loss"]["per_step"][-1] != one["loss"]["per_step"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w1", "w2"])
def test_the_advisor_estimates_a_lora_runs_measured_state(prepared, ddp_lora, name):
    assert_advisor_estimate_holds(prepared, ddp_lora[name], f"ddp-lora-{name}")
