"""Which tokenizer encodes the data, and whether it fits the model it feeds.

A model folder as users bring it holds its own tokenizer: its ids, vocabulary and special
tokens are the model's. The data must be encoded with it (a tokenizer trained on the corpus
is only for the model the pipeline builds). One function loads it, at config time and in the
data-prep job alike (distlab.data.load_tokenizer, through transformers): a tokenizer that
transformers extends on load (a Qwen2-type folder gains `<|endoftext|>` as one more id) is
decided the same way in both places. The comparison with the model is compare_with_model.
"""
from __future__ import annotations

from pathlib import Path

from distlab.config import ConfigError

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
    from distlab.data import load_tokenizer

    try:
        tokenizer = load_tokenizer(source, model_config)
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"config field '{field}': the tokenizer of '{source}' does not load as the data-prep job "
                          f"loads it: {error}") from None
    check_streamed_text_pieces(config, tokenizer, field, source)
    from distlab.data_checks import datasets_of

    if any(cfg["format"] == "chat" for cfg in datasets_of(data).values()) and not tokenizer.chat_template:
        raise ConfigError(f"config field 'data.format': chat rows are rendered with the tokenizer's own chat "
                          f"template and {source} has none (tokenizer_config.json chat_template)")


def streamed_text_files(data: dict) -> list[str]:
    """Config fields of the plain-text files data prep streams in pieces (format text, .txt)."""
    from distlab.data_checks import builder_for, datasets_of

    fields = []
    for name, cfg in datasets_of(data).items():
        prefix = "data" if name == "default" else f"data.extra.{name}"
        if cfg["source"] == "files" and cfg["format"] == "text":
            fields += [f"{prefix}.files[{i}]" for i, f in enumerate(cfg["files"]) if builder_for(f) == "text"]
    return fields


def check_streamed_text_pieces(config: dict, tokenizer, tok_field: str, source: str) -> None:
    """Refuse, before any job, a .txt file the tokenizer would encode differently in pieces
    than whole (the data-prep job refuses it too)."""
    from distlab.data_formats import pieces_split_cleanly

    streamed = streamed_text_files(config["data"])
    if not streamed:
        return
    if not pieces_split_cleanly(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]):
        raise ConfigError(f"config field '{streamed[0]}': a plain-text (.txt) file is streamed in pieces, and the "
                          f"tokenizer of '{tok_field}' ({source}) encodes pieces differently from the whole "
                          "text (it prepends a space marker to every call, as SentencePiece does); give the "
                          "data as JSON lines, one document per row, instead of .txt")
