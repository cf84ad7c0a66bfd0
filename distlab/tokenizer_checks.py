"""Which tokenizer encodes the data, and whether it fits the model it feeds.

A model folder as users bring it holds its own tokenizer: its ids, vocabulary and special
tokens are the model's. The data must be encoded with it (a tokenizer trained on the corpus
is only for the model the pipeline builds). Checked at config time from the files alone
(json + `tokenizers`, no transformers) and again in the data-prep job on the loaded
tokenizer, with the same comparison.
"""
from __future__ import annotations

import json
from pathlib import Path

from distlab.config import ConfigError

SPECIAL_ROLES = ("eos", "bos", "pad")


def tokenizer_source(config: dict) -> str | None:
    """data.tokenizer, else the model's own (model.path folder or model.hub_id), else None:
    the pipeline trains a BPE on the corpus for the model it builds."""
    data, model = config["data"], config["model"]
    return data.get("tokenizer") or model.get("path") or model.get("hub_id")


def tokenizer_files(source: str) -> tuple[Path | None, Path | None]:
    """(tokenizer.json, tokenizer_config.json) of a tokenizer folder or a tokenizer.json file;
    a tokenizer_config.json beside a given tokenizer.json belongs to it."""
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    tok_json = path if path.is_file() else folder / "tokenizer.json"
    tok_cfg = folder / "tokenizer_config.json"
    return (tok_json if tok_json.is_file() else None), (tok_cfg if tok_cfg.is_file() else None)


def _token_text(value):
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


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


def special_ids_from_files(tok_json: Path, tok_cfg: Path | None, model_cfg: dict | None, tok_name: str) -> dict:
    """eos/bos/pad ids as the job will load them: from tokenizer_config.json, else (a bare
    tokenizer.json) from the model's config.json ids; refused when EOS stays unknown."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_json))
    ids = {}
    declared = json.loads(tok_cfg.read_text()) if tok_cfg else {}
    for role in SPECIAL_ROLES:
        text = _token_text(declared.get(f"{role}_token"))
        if text is not None:
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise ConfigError(f"config field 'data.tokenizer': {tok_cfg} names {role}_token {text!r}, "
                                  f"which {tok_json} does not contain")
            ids[role] = token_id
        elif model_cfg is not None and model_special_ids(model_cfg)[role] is not None:
            model_id = _as_list(model_special_ids(model_cfg)[role])[0]
            if tokenizer.id_to_token(model_id) is None:
                raise ConfigError(f"config field 'data.tokenizer': the model's {role}_token_id {model_id} is "
                                  f"not an id of {tok_json}")
            ids[role] = model_id
    if ids.get("eos") is None:
        raise ConfigError(f"config field 'data.tokenizer': {tok_name} names no EOS token (a bare tokenizer.json "
                          "has none) and no model config.json gives an eos_token_id: documents could not be "
                          "separated; give the tokenizer's folder (with tokenizer_config.json) or a model.path "
                          "whose config.json names eos_token_id")
    ids["max_id"] = max(tokenizer.get_vocab(with_added_tokens=True).values())
    return ids


def has_chat_template(source: str) -> bool | None:
    """True/False from the tokenizer files; None when they cannot tell (hub id)."""
    path = Path(source)
    folder = path if path.is_dir() else path.parent
    if not folder.is_dir():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    cfg = folder / "tokenizer_config.json"
    return bool(cfg.is_file() and json.loads(cfg.read_text()).get("chat_template"))


def check_tokenizer(config: dict) -> None:
    data, model = config["data"], config["model"]
    source = tokenizer_source(config)
    if source is None or model.get("hub_id") and not data.get("tokenizer"):
        return  # trained by the pipeline, or loaded from the hub by id (nothing on disk to read)
    model_cfg, model_name = None, None
    if model.get("path"):
        model_name = str(Path(model["path"]) / "config.json")
        try:
            model_cfg = json.loads(Path(model_name).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config field 'model.path': {model_name} is not readable JSON ({exc})") from None
    tok_json, tok_cfg = tokenizer_files(source)
    field = "data.tokenizer" if data.get("tokenizer") else "model.path"
    if tok_json is None:
        folder = Path(source)
        if (folder / "tokenizer.model").is_file() or (folder / "vocab.json").is_file():
            return  # a slow/sentencepiece tokenizer: the data-prep job checks it once loaded
        raise ConfigError(f"config field '{field}': no tokenizer in '{source}' (no tokenizer.json); "
                          "set data.tokenizer to the model's tokenizer")
    ids = special_ids_from_files(tok_json, tok_cfg, model_cfg, str(tok_json))
    if model_cfg is not None:
        compare_with_model(ids, ids["max_id"], model_cfg, str(tok_json), model_name)
    check_streamed_text_pieces(config, tok_json, field)
    from distlab.data_checks import datasets_of

    if any(cfg["format"] == "chat" for cfg in datasets_of(data).values()) and has_chat_template(source) is False:
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


def check_streamed_text_pieces(config: dict, tok_json: Path, tok_field: str) -> None:
    """Refuse, before any job, a .txt file the tokenizer would encode differently in pieces
    than whole (the data-prep job refuses it too, for tokenizers without a tokenizer.json)."""
    from tokenizers import Tokenizer

    from distlab.data_formats import pieces_split_cleanly

    streamed = streamed_text_files(config["data"])
    if not streamed:
        return
    tokenizer = Tokenizer.from_file(str(tok_json))
    if not pieces_split_cleanly(lambda text: tokenizer.encode(text, add_special_tokens=False).ids):
        raise ConfigError(f"config field '{streamed[0]}': a plain-text (.txt) file is streamed in pieces, and the "
                          f"tokenizer of '{tok_field}' ({tok_json}) encodes pieces differently from the whole "
                          "text (it prepends a space marker to every call, as SentencePiece does); give the "
                          "data as JSON lines, one document per row, instead of .txt")
