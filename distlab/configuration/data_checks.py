"""Data inputs checked at config time, before any job starts (a bad file found inside a job
would cost the prepared data it replaces): every data file and every experiment's dataset
name (the tokenizer against the model it feeds: distlab.configuration.tokenizer_checks).

Imported by the Snakefile through distlab.configuration.config, so it stays light: json, csv and the
`tokenizers` library (Rust, ~20 ms to import), never torch or transformers.
"""
from __future__ import annotations

import codecs
import csv
import json
import os
from pathlib import Path

from distlab.errors import ConfigError

SAMPLE_ROWS = 200  # rows per file whose fields are checked
CHUNK_BYTES = 4 << 20
# The checks run on every `snakemake` call (-n included): memory stays bounded by these, never
# by a file's size, its longest line or its JSON array (a row longer than this is refused).
MAX_ROW_CHARS = 16 << 20
# File suffix -> datasets.load_dataset builder; anything else is plain text.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def packing_mode(cfg: dict) -> str:
    """The dataset's packing: as given, else documents for chat/instruction rows, blocks for text."""
    return cfg.get("packing") or ("blocks" if cfg.get("format", "text") == "text" else "documents")


def builder_for(path) -> str:
    return BUILDERS.get(Path(path).suffix.lower(), "text")


def datasets_of(data: dict) -> dict[str, dict]:
    """Every named dataset, resolved: 'default' is the data block itself; data.extra entries
    inherit its keys (split, seed, fields) and override what they name."""
    base = {k: v for k, v in data.items() if k != "extra"}
    out = {"default": base}
    for name, override in (data.get("extra") or {}).items():
        out[name] = {**base, **override}
    return out


def required_fields(cfg: dict) -> list[str]:
    return {"text": [cfg["text_field"]], "chat": [cfg["messages_field"]],
            "instruction": [cfg["prompt_field"], cfg["response_field"]]}[cfg["format"]]


# -- data files ------------------------------------------------------------------------------------
def check_utf8(path: Path, where: str) -> None:
    """The whole file decodes as UTF-8 (streamed: memory stays at one chunk)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines_before, offset = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                bad = chunk[:max(exc.start, 0)]
                line = lines_before + bad.count(b"\n") + 1
                raise ConfigError(f"config field '{where}': {path}:{line}: not UTF-8 text (byte "
                                  f"{offset + exc.start}: {exc.reason}); re-encode the file as UTF-8") from None
            lines_before += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ConfigError(f"config field '{where}': {path}:{lines_before + 1}: file ends inside a "
                              "UTF-8 character (truncated?)") from None


def _check_row(row, fields: list[str], fmt: str, path: Path, where: str, at: str) -> None:
    if not isinstance(row, dict):
        raise ConfigError(f"config field '{where}': {path}:{at}: a row must be a JSON object, found "
                          f"{type(row).__name__}")
    for name in fields:
        if name not in row:
            raise ConfigError(f"config field '{where}': {path}:{at}: no field '{name}' (row has "
                              f"{sorted(row)[:8]}); set the data.*_field that names it")
    if fmt == "chat":
        messages = row[fields[0]]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                     for m in messages):
            raise ConfigError(f"config field '{where}': {path}:{at}: '{fields[0]}' must be a list of "
                              "{role, content} messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"config field '{where}': {path}:{at}: no assistant message: nothing to train on")
    else:
        for name in fields:
            if not isinstance(row[name], str):
                raise ConfigError(f"config field '{where}': {path}:{at}: field '{name}' is "
                                  f"{type(row[name]).__name__}, not text")


def _json_array_rows(path: Path, where: str):
    """(index, row) of a file holding one JSON array, decoded one element at a time from
    CHUNK_BYTES reads (raw_decode): memory holds a read and one row, never the array. The
    whole array is walked, so a syntax error anywhere in it is found (line named)."""
    decoder = json.JSONDecoder()
    buffer, offset_lines, index, done = "", 0, 0, False

    def fail(message, at=0):
        line = offset_lines + buffer.count("\n", 0, at) + 1
        raise ConfigError(f"config field '{where}': {path}:{line}: {message}")

    with open(path, encoding="utf-8") as fh:
        def fill() -> bool:
            nonlocal buffer
            chunk = fh.read(CHUNK_BYTES)
            buffer += chunk
            return bool(chunk)

        def skip(pos):  # whitespace, reading on when the buffer ends
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buffer) or not fill():
                    return pos

        pos = skip(0)
        if buffer[pos:pos + 1] != "[":
            fail("not a JSON array", pos)
        pos = skip(pos + 1)
        if buffer[pos:pos + 1] == "]":
            done = True
        while not done:
            while True:  # one element, reading on until it decodes or is too long
                try:
                    row, end = decoder.raw_decode(buffer, pos)
                    break
                except RecursionError:
                    fail("a row nested too deeply", pos)
                except json.JSONDecodeError as exc:
                    if len(buffer) - pos > MAX_ROW_CHARS:
                        fail(f"a row longer than {MAX_ROW_CHARS >> 20} MiB (or invalid JSON: {exc.msg})", pos)
                    if not fill():
                        fail(f"invalid JSON ({exc.msg})", exc.pos)
            yield index, row
            index += 1
            pos = skip(end)
            if buffer[pos:pos + 1] == "]":
                done = True
            elif buffer[pos:pos + 1] == ",":
                pos = skip(pos + 1)
            else:
                fail("invalid JSON (expected ',' or ']' between rows)", pos)
            if pos > CHUNK_BYTES:  # forget what was read (keeping the line count), a read's worth at a time
                offset_lines += buffer.count("\n", 0, pos)
                buffer, pos = buffer[pos:], 0
        if skip(pos + 1) < len(buffer):
            fail("text after the JSON array", pos + 1)


def _check_json_rows(path: Path, fields, fmt, where) -> None:
    with open(path, encoding="utf-8") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith("["):  # one JSON array of records (datasets' json builder reads it too)
        seen = 0
        for index, row in _json_array_rows(path, where):
            if index < SAMPLE_ROWS:
                _check_row(row, fields, fmt, path, where, f"row {index}")
            seen += 1
        if not seen:
            raise ConfigError(f"config field '{where}': {path}: the JSON array holds no rows")
        return
    seen = 0
    with open(path, encoding="utf-8") as fh:
        line_no = 0
        while line := fh.readline(MAX_ROW_CHARS + 1):
            line_no += 1
            if len(line) > MAX_ROW_CHARS:
                raise ConfigError(f"config field '{where}': {path}:{line_no}: a JSON line longer than "
                                  f"{MAX_ROW_CHARS >> 20} MiB")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config field '{where}': {path}:{line_no}: not a JSON line ({exc.msg})") from None
            except RecursionError:
                raise ConfigError(f"config field '{where}': {path}:{line_no}: a row nested too deeply") from None
            _check_row(row, fields, fmt, path, where, str(line_no))
            seen += 1
            if seen >= SAMPLE_ROWS:
                return
    if not seen:
        raise ConfigError(f"config field '{where}': {path}: no JSON rows (only blank lines)")


def _check_csv_rows(path: Path, fields, fmt, where) -> None:
    if fmt == "chat":
        raise ConfigError(f"config field '{where}': {path}: chat rows (lists of messages) need JSON lines "
                          "or Parquet, not CSV")
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        try:  # csv's own field_size_limit bounds a row's memory
            missing = [f for f in fields if f not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"config field '{where}': {path}:1: CSV header has no column {missing[0]!r} "
                                  f"(columns: {reader.fieldnames})")
            if next(reader, None) is None:
                raise ConfigError(f"config field '{where}': {path}: CSV file has a header but no rows")
        except csv.Error as exc:
            raise ConfigError(f"config field '{where}': {path}:{reader.line_num}: unreadable CSV ({exc})") from None


def _check_parquet(path: Path, fields, where) -> None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as exc:
        raise ConfigError(f"config field '{where}': {path}: not a readable Parquet file ({exc})") from None
    names = meta.schema_arrow.names
    missing = [f for f in fields if f not in names]
    if missing:
        raise ConfigError(f"config field '{where}': {path}: Parquet file has no column {missing[0]!r} "
                          f"(columns: {names})")
    if meta.metadata.num_rows == 0:
        raise ConfigError(f"config field '{where}': {path}: Parquet file holds no rows")


def check_data_file(name: str, cfg: dict, where: str) -> None:
    """Exists, readable, non-empty, UTF-8 (text formats), fields present in a sample of rows."""
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"config field '{where}': file '{name}' does not exist")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"config field '{where}': file '{name}' is not readable (permissions)")
    if path.stat().st_size == 0:
        raise ConfigError(f"config field '{where}': file '{name}' is empty")
    builder = builder_for(path)
    fields = required_fields(cfg)
    if builder == "parquet":
        return _check_parquet(path, fields, where)
    check_utf8(path, where)
    if builder == "json":
        _check_json_rows(path, fields, cfg["format"], where)
    elif builder == "csv":
        _check_csv_rows(path, fields, cfg["format"], where)
    else:
        if cfg["format"] != "text":
            raise ConfigError(f"config field '{where}': {path}: a plain-text file has no "
                              f"{cfg['format']} fields; use JSON lines, CSV or Parquet")
        with open(path, encoding="utf-8") as fh:  # a read at a time: a line may be the whole file
            if not any(chunk.strip() for chunk in iter(lambda: fh.read(CHUNK_BYTES), "")):
                raise ConfigError(f"config field '{where}': file '{name}' holds only whitespace")


def check_data(config: dict) -> None:
    """Every dataset's files and its source against its format (config time). The tokenizer
    is checked next (distlab.configuration.tokenizer_checks.check_tokenizer, by distlab.configuration.config), then
    check_experiment_datasets."""
    data = config["data"]
    for name, cfg in datasets_of(data).items():
        prefix = "data" if name == "default" else f"data.extra.{name}"
        if cfg["source"] == "files":
            if not cfg["files"]:
                raise ConfigError(f"config field '{prefix}.files': source 'files' needs at least one file")
            for index, file_name in enumerate(cfg["files"]):
                check_data_file(file_name, cfg, f"{prefix}.files[{index}]")
        if cfg["source"] == "python-docs" and cfg["format"] == "chat":
            raise ConfigError(f"config field '{prefix}.format': python-docs holds no chat rows; use format "
                              "text, or source python-docs-instructions with format instruction")
        if cfg["format"] == "text" and cfg.get("packing") not in (None, "blocks"):
            raise ConfigError(f"config field '{prefix}.packing': {cfg['packing']} packs rows that are documents, "
                              "as chat and instruction rows are; text rows may be pieces of one file "
                              "(a .txt streams in pieces), so text is packed as blocks")
        if cfg["source"] == "python-docs-instructions" and cfg["format"] != "instruction":
            raise ConfigError(f"config field '{prefix}.format': python-docs-instructions rows are "
                              "instructions; set format: instruction")


def check_experiment_datasets(config: dict) -> None:
    """Every experiment's `dataset` names one of the data block's datasets."""
    data = config["data"]
    for stage, block in (config.get("stages") or {}).items():
        for index, exp in enumerate((block or {}).get("experiments") or []):
            chosen = exp.get("dataset", (config.get("defaults") or {}).get("dataset", "default"))
            if chosen not in datasets_of(data):
                raise ConfigError(f"config field 'stages.{stage}.experiments[{index}].dataset': no dataset "
                                  f"{chosen!r}; known: {sorted(datasets_of(data))} (data.extra names them)")
