"""Scaled-down CPU twins of the GPU presets (config/presets/*.yaml): the preset's own model
shape divided down to a few million parameters, built locally (a BPE tokenizer trained on
the local corpus, random weights), so the preset's strategy and settings can run on CPU
ranks in the tests (tests/test_presets.py) and a preset that cannot run is caught there.

Kept from the preset's model: intermediate/hidden, attention heads per key-value head
(GQA group size), head count and layer count divided by the same factor as the hidden size
(at least 1 key-value head and 2 layers), tied or untied embeddings, the family (Llama).
The vocabulary is divided by the same factor too (a tokenizer of that size is trained).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent.parent
PRESETS = REPO / "config" / "presets"
TWIN_HIDDEN = 256


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def preset_config(name: str) -> dict:
    return yaml.safe_load((PRESETS / f"{name}.yaml").read_text())


def preset_model_config(name: str) -> dict:
    path = Path(preset_config(name)["model"]["path"])
    return json.loads(((path if path.is_absolute() else REPO / path) / "config.json").read_text())


def twin_shape(model_config: dict, hidden: int = TWIN_HIDDEN) -> dict:
    """The twin's `model.build` block and vocabulary size for a preset model's config.json."""
    factor = model_config["hidden_size"] / hidden
    heads, kv = model_config["num_attention_heads"], model_config.get("num_key_value_heads") or \
        model_config["num_attention_heads"]
    group = heads // kv
    kv_twin = max(1, round(kv / factor))
    heads_twin = kv_twin * group
    if hidden % heads_twin:
        raise ValueError(f"twin hidden {hidden} is not divisible by its {heads_twin} heads")
    intermediate = round(model_config["intermediate_size"] / factor)
    return {"hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": max(2, round(model_config["num_hidden_layers"] / factor)),
            "num_attention_heads": heads_twin, "num_key_value_heads": kv_twin,
            "max_position_embeddings": 128,
            "tie_word_embeddings": bool(model_config.get("tie_word_embeddings", False)),
            "seed": 0, "vocab_size": max(512, round(model_config["vocab_size"] / factor))}


def build_twin(name: str, out: Path, seq_len: int) -> dict:
    """tokenizer/, model/ (safetensors + its tokenizer), data<seq_len>/ and hardware.json for
    the twin of preset `name`, under `out`, with the pipeline's own code. Returns the shape."""
    from distlab.data_prep import data
    from distlab.configuration import hardware
    from distlab.runtime import model

    shape = twin_shape(preset_model_config(name))
    out = Path(out)
    texts = data.corpus_texts({"source": "python-docs"})
    tok = data.train_tokenizer(texts, shape["vocab_size"], out / "tokenizer")
    data.build_dataset(texts, tok, seq_len, 0.05, 0, out / f"data{seq_len}")
    built = model.build_base_model({k: v for k, v in shape.items() if k != "vocab_size"}, tok, out / "model")
    (out / "hardware.json").write_text(json.dumps(hardware.describe("twinbox", probe=False)))
    return {**shape, "parameters": built["parameters"], "config": built["config"]}


def twin_config(name: str, folder: Path, **defaults) -> dict:
    """The preset's config with the twin's model and tokenizer, on CPU ranks; `defaults`
    shorten the run (steps, seq_len, ...). Everything else (strategy, world size, LoRA,
    ZeRO stage and offload, FSDP settings, precision, accumulation) is the preset's."""
    raw = preset_config(name)
    raw["model"] = {"path": str(Path(folder) / "model")}
    raw["data"] = {**raw.get("data", {}), "tokenizer": str(Path(folder) / "model")}
    raw["advisor"] = {**raw.get("advisor", {}), "gpu_memory_gib": None}
    raw["defaults"] = {**raw.get("defaults", {}), "device": "cpu", **defaults}
    return raw
