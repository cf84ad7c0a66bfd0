"""A model folder is checked before any job: every parameter of its architecture has a stored
weight of its shape (read from the safetensors headers, nothing loaded), its sizes are
plausible, no custom code, and its tokenizer is decided by the one function the data-prep
job uses."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import tiny_config


@pytest.fixture
def model_copy(prepared, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(prepared / "model", folder)
    return folder


def probe_config(folder, tmp_path):
    cfg = tiny_config({"ddp": {"experiments": [{"world_size": 1}]}}, results_dir=str(tmp_path / "results"))
    cfg["model"]["path"] = str(folder)
    cfg["data"] = {"source": "files", "files": [str(write_corpus(tmp_path))]}
    return cfg


def write_corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}: the quick brown fox"}) + "\n" for i in range(50)))
    return path


def test_a_folder_missing_weights_stops_the_run_before_any_job_naming_them(model_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    from distlab.configuration.config import ConfigError, load

    weights = load_file(str(model_copy / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if "layers.1." not in k}  # one decoder layer's weights gone
    save_file(kept, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    load(probe_config(model_copy, tmp_path), gpu_count=0)  # without probing the machine: not looked at
    with pytest.raises(ConfigError, match=r"lack \d+ and misshape 0 of the \d+ parameters .*model\.layers\.1\."):
        load(probe_config(model_copy, tmp_path), gpu_count=0, probe=True)


def test_weights_of_the_wrong_shape_are_named(model_copy):
    from safetensors.torch import load_file, save_file

    from distlab.configuration.input_checks import ConfigError, model_config

    weights = load_file(str(model_copy / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, str(model_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"misshape 1 .*model\.norm\.weight \[63\] \(the architecture has \[64\]\)"):
        model_config(model_copy, weights=True)


def test_a_config_claiming_trillions_of_parameters_beside_a_tiny_file_is_refused_without_building_it(model_copy):
    from safetensors.torch import save_file

    import torch

    from distlab.configuration.input_checks import ConfigError, model_config

    config = json.loads((model_copy / "config.json").read_text())
    config.update(hidden_size=65536, num_hidden_layers=64, intermediate_size=262144, vocab_size=256000)
    (model_copy / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(model_copy / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"describes a model of about \d\.\d+e\+12 parameters, but its weight files "
                                          r"hold 1 values"):
        model_config(model_copy, weights=True)


def test_a_truncated_weights_file_is_named(model_copy):
    from distlab.configuration.input_checks import ConfigError, model_config

    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ConfigError, match=r"model\.safetensors is truncated"):
        model_config(model_copy, weights=True)


def test_custom_code_is_refused_at_config_time(model_copy, tmp_path):
    from distlab.configuration.config import ConfigError, load

    config = json.loads((model_copy / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'model\.path': .*custom code \(auto_map"):
        load(probe_config(model_copy, tmp_path), gpu_count=0)  # the plain config check, no probing needed


def test_a_weight_index_naming_files_outside_the_model_folder_is_refused_naming_it(model_copy, tmp_path):
    """model.safetensors.index.json may name only files of its own folder: '../' would have the
    check, the loaders and the export read (and copy) any file on the machine."""
    from safetensors import safe_open

    from distlab.records.export_files import WeightIndexError, weight_index
    from distlab.configuration.input_checks import ConfigError, model_config

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(model_copy / "model.safetensors", elsewhere / "model.safetensors")
    with safe_open(str(elsewhere / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: "../elsewhere/model.safetensors" for n in names}}))
    with pytest.raises(ConfigError, match=rf"model\.path.*{index}.*outside its folder.*\.\./elsewhere"):
        model_config(model_copy, weights=True)
    with pytest.raises(WeightIndexError, match=str(index)):  # the jobs' and the export's reader alike
        weight_index(model_copy)
    index.write_text(json.dumps({"weight_map": {n: str(elsewhere / "model.safetensors") for n in names}}))
    with pytest.raises(ConfigError, match="outside its folder"):
        model_config(model_copy, weights=True)


def test_the_job_s_loader_refuses_missing_weights_too(model_copy):
    from safetensors.torch import load_file, save_file

    from distlab.runtime.model import load_model

    weights = load_file(str(model_copy / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(model_copy / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lack 1 parameter\(s\) .*lm_head\.weight"):
        load_model(str(model_copy))


def test_a_tokenizer_transformers_extends_on_load_is_decided_at_config_time_as_in_the_job(tmp_path):
    """A Qwen2-type folder whose tokenizer lacks <|endoftext|>: AutoTokenizer adds it as one
    more id, past the model's vocab_size. The files alone said the tokenizer fits; the job
    refused it. Both now load it with distlab.data_prep.data.load_tokenizer and refuse it alike."""
    from test_data_tokenizer import _own_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    from distlab.configuration.config import ConfigError, load
    from distlab.data_prep.data import load_tokenizer

    folder = tmp_path / "qwen"
    tok = _own_tokenizer(folder, specials=("<s>", "<|im_end|>", "<pad>"))
    declared = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**declared, "tokenizer_class": "Qwen2Tokenizer"}))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    with pytest.raises(ConfigError, match=r"ids up to 300 .*vocab_size 300") as at_config_time:
        load(probe_config(folder, tmp_path), gpu_count=0)
    with pytest.raises(ConfigError) as in_the_job:
        load_tokenizer(str(folder), str(folder / "config.json"))  # scripts/prepare_data.py's call
    assert str(in_the_job.value) == str(at_config_time.value)
