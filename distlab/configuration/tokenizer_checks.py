"""Which tokenizer encodes the data, and whether it fits the model it feeds.

A model folder as users bring it holds its own tokenizer: its ids, vocabulary and special
tokens are the model's. The data must be encoded with it (a tokenizer trained on the corpus
is only for the model the pipeline builds). One function loads it, at config time and in the
data-prep job alike (load_tokenizer here, through transformers; data prep imports it): a tokenizer that
transformers extends on load (a Qwen2-type folder gains `<|endoftext|>` as one more id) is
decided the same way in both places. The comparison with the model is compare_with_model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from distlab.errors import ConfigError

SPECIAL_ROLES = ("eos", "bos", "pad")


def tokenizer_source(config: dict) -> str | None:
    """data.tokenizer, else the model's own (model.path folder or model.hub_id), else None:
    the pipeline trains a BPE on the corpus for the model it builds."""
    data, model = config["data"], config["model"]
    return data.get("tokenizer") or model.get("path") or model.get("hub_id")


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def model_special_ids(model_cfg: dict) -> dict:
    """eos/bos/pad ids of a model config.json (eos may be a list)."""
    return {role: model_cfg.get(f"{role}_token_id") for role in SPECIAL_ROLES}


def compare_with_model(tok_ids: dict, max_id: int, model_cfg: dict, tok_name: str, model_name: str) -> None:
    """Refuse a tokenizer the model cannot embed, or whose special ids differ from the model's."""
    vocab = model_cfg.get("vocab_size")
    if vocab is not None and max_id >= vocab:
        raise ConfigError(f"config field 'data.tokenizer': tokenizer {tok_name} has ids up to {max_id} but the "
                          f"model's {model_name} has vocab_size {vocab}: those ids have no embedding "
                          "(use the model's own tokenizer)")
    for role, model_value in model_special_ids(model_cfg).items():
        tok_id = tok_ids.get(role)
        if tok_id is None or model_value is None:
            continue
        if tok_id not in _as_list(model_value):
            raise ConfigError(f"config field 'data.tokenizer': tokenizer {tok_name} has {role}_token_id "
                              f"{tok_id} but the model's {model_name} says {role}_token_id {model_value}")


def check_tokenizer(config: dict) -> None:
    """The tokenizer the data-prep job will use, loaded as it will load it, against the model."""
    data, model = config["data"], config["model"]
    source = tokenizer_source(config)
    if source is None or model.get("hub_id") and not data.get("tokenizer"):
        return  # trained by the pipeline, or loaded from the hub by id (nothing on disk to read)
    field = "data.tokenizer" if data.get("tokenizer") else "model.path"
    model_config = str(Path(model["path"]) / "config.json") if model.get("path") else None
    try:
        tokenizer = load_tokenizer(source, model_config)
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"config field '{field}': the tokenizer of '{source}' does not load as the data-prep job "
                          f"loads it: {error}") from None
    check_streamed_text_pieces(config, tokenizer, field, source)
    from distlab.configuration.data_checks import datasets_of

    if any(cfg["format"] == "chat" for cfg in datasets_of(data).values()) and not tokenizer.chat_template:
        raise ConfigError(f"config field 'data.format': chat rows are rendered with the tokenizer's own chat "
                          f"template and {source} has none (tokenizer_config.json chat_template)")


def streamed_text_files(data: dict) -> list[str]:
    """Config fields of the plain-text files data prep streams in pieces (format text, .txt)."""
    from distlab.configuration.data_checks import builder_for, datasets_of

    fields = []
    for name, cfg in datasets_of(data).items():
        prefix = "data" if name == "default" else f"data.extra.{name}"
        if cfg["source"] == "files" and cfg["format"] == "text":
            fields += [f"{prefix}.files[{i}]" for i, f in enumerate(cfg["files"]) if builder_for(f) == "text"]
    return fields


PIECE_PROBES = (("x\n", "y"), ("Hello world.\n", "Next line"))


def pieces_split_cleanly(encode) -> bool:
    """Whether `encode` (text -> ids, no special tokens) gives a text cut after a line end
    ("x\ny" -> "x\n" + "y") the same ids apart as whole. True for byte-level BPE (GPT-2,
    Llama-3, Qwen2, GPT-NeoX); false for tokenizers that prepend a space marker to every call
    (SentencePiece's Metaspace: Llama-2, Mistral). Config time asks it of `tokenizers`, the
    data-prep job of the loaded transformers tokenizer (the same Rust object when fast)."""
    return all(encode(a + b) == encode(a) + encode(b) for a, b in PIECE_PROBES)


def check_streamed_text_pieces(config: dict, tokenizer, tok_field: str, source: str) -> None:
    """Refuse, before any job, a .txt file the tokenizer would encode differently in pieces
    than whole (the data-prep job refuses it too)."""
    streamed = streamed_text_files(config["data"])
    if not streamed:
        return
    if not pieces_split_cleanly(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]):
        raise ConfigError(f"config field '{streamed[0]}': a plain-text (.txt) file is streamed in pieces, and the "
                          f"tokenizer of '{tok_field}' ({source}) encodes pieces differently from the whole "
                          "text (it prepends a space marker to every call, as SentencePiece does); give the "
                          "data as JSON lines, one document per row, instead of .txt")


def load_tokenizer(path: str | os.PathLike, model_config: str | os.PathLike | None = None):
    """A tokenizer folder (or hub id), or a tokenizer.json: with a tokenizer_config.json beside
    it that folder is loaded; a bare one takes EOS/BOS/PAD from the model's config.json ids."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file() and (path.parent / "tokenizer_config.json").is_file():
        path = path.parent
    if path.is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    elif _generic_fast_folder(path):
        # The class AutoTokenizer would pick for this folder, loaded without importing
        # AutoTokenizer: that import brings in torch (3-5 s of CPU for a data-prep job).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if model_config is not None:
        model_cfg = json.loads(Path(model_config).read_text())
        for role, value in model_special_ids(model_cfg).items():
            if value is not None and getattr(tokenizer, f"{role}_token_id") is None:
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(_as_list(value)[0]))
        ids = {role: getattr(tokenizer, f"{role}_token_id") for role in ("eos", "bos", "pad")}
        compare_with_model(ids, max(tokenizer.get_vocab().values()), model_cfg, str(path), str(model_config))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {path} names no EOS token (a bare tokenizer.json has none, and no model "
                         "config.json gives an eos_token_id): documents could not be separated; give the "
                         "tokenizer's folder (with tokenizer_config.json) or a model.path whose config.json names "
                         "eos_token_id")
    return tokenizer


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers' class for any tokenizer.json


def _generic_fast_folder(path: Path) -> bool:
    """A local folder whose tokenizer_config.json names the generic fast class and that holds
    no model config.json (which AutoTokenizer would also read): the built tokenizer's folder."""
    config = path / "tokenizer_config.json"
    if not (config.is_file() and (path / "tokenizer.json").is_file()) or (path / "config.json").exists():
        return False
    try:
        return json.loads(config.read_text()).get("tokenizer_class") in GENERIC_FAST
    except (OSError, ValueError):
        return False
