"""QLoRA promises: the base really is 4-bit NF4 (bitsandbytes Linear4bit, read from the built
model), only the adapters train, the export is an adapter folder plain peft loads on the
full-precision base, and where the 4-bit base cannot go the config says why."""
import math

import pytest
import torch

from conftest import assert_advisor_estimate_holds, resolve, run_experiment

QLORA = {"method": "qlora", "strategy": "ddp"}


@pytest.mark.parametrize("strategy, extra, why", [
    ("deepspeed", {"deepspeed": {"zero_stage": 3}}, "ZeRO-3 partitions every parameter"),
    ("fsdp", {}, "DTensor shard"),
    ("tp", {}, "cannot be split"),
    ("pp", {}, "stage loader"),
])
def test_qlora_is_refused_where_the_4bit_base_cannot_go_naming_why(strategy, extra, why):
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=rf"experiments\[0\]\.method': qlora under strategy {strategy}: .*{why}"):
        resolve({"method": "qlora", "strategy": strategy, "world_size": 2, **extra})


def test_qlora_without_bitsandbytes_installed_is_refused_before_any_job(monkeypatch):
    import importlib.util

    from distlab.configuration.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name,
                                                                                                               *a))
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.method': qlora .*pip install 'bitsandbytes"):
        resolve(QLORA)


def test_a_qlora_run_is_not_merged_into_its_4bit_base():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"export\.merge.*full-precision base"):
        resolve({**QLORA, "export": {"merge": True}})


def test_a_qlora_label_on_a_model_without_4bit_layers_fails_the_run(prepared):
    from distlab.runtime.model import load_model
    from distlab.runtime.qlora import check_quantized, quantization_facts

    facts = quantization_facts(load_model(prepared / "model"))  # the full-precision base, as LoRA loads it
    assert facts["linear4bit_layers"] == 0
    assert "holds no bitsandbytes Linear4bit layer" in check_quantized(facts, resolve(QLORA))


@pytest.fixture(scope="module")
def ddp_qlora(prepared, tmp_path_factory):
    """QLoRA under DDP, 2 ranks x 2 sequences, checkpoints every 2 steps (for the validation)."""
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    spec = resolve({**QLORA, "world_size": 2, "micro_batch": 2, "checkpoint_every": 2})
    assert spec["id"] == "ddp-qlora-w2-mb2-ga1"
    return run_experiment(prepared, run_dir, spec), run_dir


@pytest.mark.slow
def test_qlora_trains_adapters_on_a_4bit_base_and_exports_them_for_the_full_precision_base(prepared, ddp_qlora):
    from peft import PeftModel
    from safetensors.torch import load_file

    from distlab.checkpoints.export import eval_batch
    from distlab.jobs.validate import validate_run
    from distlab.report.cards import COMPARED
    from distlab.report.cards.finetune_tools import GOAL_QLORA
    from distlab.report.cards.stage7_finetune import build
    from distlab.runtime.model import load_model

    run, run_dir = ddp_qlora
    built = run["as_built"]["quantization"]
    # The tiny model's two decoder layers hold 7 Linear layers each; lm_head stays full precision.
    assert built["linear4bit_layers"] == 14 and built["quant_types"] == ["nf4"] and built["double_quantisation"]
    assert built["compute_dtypes"] == ["float32"]
    assert built["bytes_per_quantised_parameter"] == 0.5
    assert run["as_built"]["outer_wrapper"] == "DistributedDataParallel"
    assert run["parameters"]["trainable"] < run["parameters"]["total"]
    assert_advisor_estimate_holds(prepared, run, "ddp-qlora-w2")  # weights at 0.5 byte per 4-bit parameter
    from card_runs import changed, report_run

    card = build([changed(report_run(run_dir), machine="testbox")])
    assert {g.text: g.status for g in card.goals}[GOAL_QLORA] == COMPARED  # measured, no LoRA twin here
    assert card.tables[-1].frame["4-bit layers"].tolist() == [14]
    losses = run["loss"]["per_step"]
    assert all(math.isfinite(loss) for loss in losses), losses
    final = run_dir / "checkpoint" / "final"
    state = load_file(final / "state" / "model.safetensors")
    assert state and all("lora_" in name for name in state)
    # The adapters trained: PEFT starts every lora_B at zero, and the optimizer moved them (six
    # steps on the tiny model do not lower the loss on every Python's pydoc corpus).
    assert all(tensor.abs().max().item() > 0 for name, tensor in state.items() if "lora_B" in name)
    # A user's load: plain peft, the adapter folder on the full-precision base.
    adapted = PeftModel.from_pretrained(load_model(prepared / "model"), str(final / "export")).eval()
    with torch.no_grad():
        logits = adapted(input_ids=eval_batch(prepared / "data32")).logits
    recorded = load_file(final / "eval_logits.safetensors")
    assert (logits - recorded["logits"]).abs().max().item() <= 1e-5
    # The training model (4-bit base) is not the full-precision one: the quantisation shows.
    assert (recorded["training_logits"] - recorded["logits"]).abs().max().item() > 1e-4
    # The checkpoint validation path: reload, resume from step 4 (on the 4-bit base), reshard to
    # one rank, and the export checked as a user opens it.
    result = validate_run(run_dir, str(prepared / "model"), str(prepared / "data32"),
                          run_dir / "validation.json", log_path=str(run_dir / "validate.log"))
    assert result["passed"] is True, result
    assert "4-bit NF4" in result["checks"]["export"]["training_model_note"]


@pytest.mark.slow
def test_qlora_under_deepspeed_zero2_trains_what_ddp_trains(prepared, ddp_qlora, tmp_path):
    spec = resolve({**QLORA, "strategy": "deepspeed", "world_size": 2, "micro_batch": 2,
                    "deepspeed": {"zero_stage": 2}},
                   stage="deepspeed")
    run = run_experiment(prepared, tmp_path / "z2", spec, checkpoint=False)
    assert run["as_built"]["quantization"]["linear4bit_layers"] == 14
    assert run["as_built"]["outer_wrapper"] == "DeepSpeedEngine"
    for a, b in zip(ddp_qlora[0]["loss"]["per_step"], run["loss"]["per_step"], strict=True):
        assert abs(a - b) <= 1e-5
    assert_advisor_estimate_holds(prepared, run, "z2-qlora-w2")
