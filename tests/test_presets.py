"""Each GPU preset (config/presets/*.yaml) runs on CPU as a scaled-down twin: the preset's
model shape divided down to a few million parameters (distlab.tools.preset_twins), built here, and
the preset's own experiments (strategy, world size, LoRA, ZeRO stage and offload, FSDP
settings, precision, accumulation) run for 2 short steps, so a preset that cannot run is
caught here rather than on the user's GPUs.

What cannot be kept on CPU: `device: cuda` (the twin runs on CPU ranks over gloo; FSDP bf16
runs its MixedPrecisionPolicy there too) and the presets' sequence lengths / step counts
(shortened to 16 tokens, 2 steps)."""
from __future__ import annotations

import json
import time

import pytest

from conftest import run_experiment
from distlab.tools import advisor, advisor_check, preset_twins
from distlab.configuration.config import load

SEQ = 16
SHORT = {"steps": 2, "untimed_steps": 1, "seq_len": SEQ}
PRESETS = preset_twins.preset_names()


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """One built twin per distinct preset model (the two 7B presets share one)."""
    built, out = {}, {}
    for name in PRESETS:
        key = json.dumps(preset_twins.twin_shape(preset_twins.preset_model_config(name)), sort_keys=True)
        if key not in built:
            folder = tmp_path_factory.mktemp("twin")
            built[key] = (folder, preset_twins.build_twin(name, folder, SEQ))
        out[name] = built[key]
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_twin_keeps_the_preset_architecture_ratios(name, twins):
    big = preset_twins.preset_model_config(name)
    _, twin = twins[name]
    small = twin["config"]
    assert small["model_type"] == big["model_type"] == "llama"
    assert small["intermediate_size"] / small["hidden_size"] == pytest.approx(
        big["intermediate_size"] / big["hidden_size"], rel=0.01)
    assert (small["num_attention_heads"] // small["num_key_value_heads"]
            == big["num_attention_heads"] // big.get("num_key_value_heads", big["num_attention_heads"]))
    factor = big["hidden_size"] / small["hidden_size"]
    assert small["num_attention_heads"] >= big["num_attention_heads"] / factor
    assert small["num_hidden_layers"] == max(2, round(big["num_hidden_layers"] / factor))
    assert small["tie_word_embeddings"] == big.get("tie_word_embeddings", False)
    assert 1e6 <= twin["parameters"] <= 6.5e6  # Llama 3.1's 128k vocabulary divided down: 8k, 5.8M in all


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_on_cpu_as_its_twin(name, twins, tmp_path):
    folder, _ = twins[name]
    raw = preset_twins.twin_config(name, folder, **SHORT)
    config, specs = load(raw, gpu_count=0)  # the schema and every config-time check, on the twin
    preset = preset_twins.preset_config(name)
    wanted = [e for stage in preset["stages"].values() for e in stage["experiments"]]
    assert len(specs) == len(wanted)
    shape = advisor.model_shape(json.loads((folder / "model" / "config.json").read_text()))
    for experiment, spec in specs.items():
        assert spec["device"] == "cpu" and spec["method"] == preset["defaults"]["method"]
        assert spec["precision"] == preset["defaults"]["precision"]
        start = time.perf_counter()
        run = run_experiment(folder, tmp_path / experiment, spec, checkpoint=False)
        assert run["status"] == "ok", (experiment, run.get("error"))
        run.setdefault("machine", "twin")
        run.setdefault("experiment", experiment)
        (row,) = advisor_check.check_against_runs({"model": {"shape": shape}}, [run])
        assert row["verdict"] == "right", row
        print(f"{name} {experiment}: {time.perf_counter() - start:.1f} s, measured/estimated "
              f"{row['measured/estimated']}")
