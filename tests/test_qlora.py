"""QLoRA promises: the base really is 4-bit NF4 (bitsandbytes Linear4bit, read from the built
model), only the adapters train, the export is an adapter folder plain peft loads on the
full-precision base, and where the 4-bit base cannot go the config says why."""
import pytest
import torch

from conftest import resolve, run_experiment

QLORA = {"method": "qlora", "strategy": "ddp"}


@pytest.mark.parametrize("strategy, extra, why", [
    ("deepspeed", {"deepspeed": {"zero_stage": 3}}, "partitions the module's parameters"),
    ("fsdp", {}, "DTensor shard"),
    ("tp", {}, "cannot be split"),
    ("pp", {}, "stage loader"),
])
def test_qlora_is_refused_where_the_4bit_base_cannot_go_naming_why(strategy, extra, why):
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=rf"experiments\[0\]\.method': qlora under strategy {strategy}: .*{why}"):
        resolve({"method": "qlora", "strategy": strategy, "world_size": 2, **extra})


def test_a_qlora_run_is_not_merged_into_its_4bit_base():
    from distlab.configuration.config import ConfigError

    with pytest.raises(ConfigError, match=r"export\.merge.*full-precision base"):
        resolve({**QLORA, "export": {"merge": True}})


@pytest.mark.slow
def test_qlora_trains_adapters_on_a_4bit_base_and_exports_them_for_the_full_precision_base(prepared, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from distlab.checkpoints.export import eval_batch
    from distlab.runtime.model import load_model

    spec = resolve({**QLORA, "world_size": 2, "micro_batch": 2})
    assert spec["id"] == "ddp-qlora-w2-mb2-ga1"
    run = run_experiment(prepared, tmp_path / "run", spec)
    built = run["as_built"]["quantization"]
    # The tiny model's two decoder layers hold 7 Linear layers each; lm_head stays full precision.
    assert built["linear4bit_layers"] == 14 and built["quant_types"] == ["nf4"] and built["double_quantisation"]
    assert built["compute_dtypes"] == ["float32"]
    assert built["bytes_per_quantised_parameter"] == 0.5
    assert run["as_built"]["outer_wrapper"] == "DistributedDataParallel"
    assert run["parameters"]["trainable"] < run["parameters"]["total"]
    losses = run["loss"]["per_step"]
    assert losses[-1] < losses[0], losses
    final = tmp_path / "run" / "checkpoint" / "final"
    state = load_file(final / "state" / "model.safetensors")
    assert state and all("lora_" in name for name in state)
    # A user's load: plain peft, the adapter folder on the full-precision base.
    adapted = PeftModel.from_pretrained(load_model(prepared / "model"), str(final / "export")).eval()
    with torch.no_grad():
        logits = adapted(input_ids=eval_batch(prepared / "data32")).logits
    recorded = load_file(final / "eval_logits.safetensors")
    assert (logits - recorded["logits"]).abs().max().item() <= 1e-5
    # The training model (4-bit base) is not the full-precision one: the quantisation shows.
    assert (recorded["training_logits"] - recorded["logits"]).abs().max().item() > 1e-4
