"""Promises about bad data files: each stops the config before any job, naming file and line."""
import json

import pytest

from conftest import tiny_config


def _load_with(files, **data):
    from distlab.configuration.config import load

    cfg = tiny_config({"ddp": {"experiments": [{"strategy": "ddp"}]}})
    cfg["data"] = {"source": "files", "files": [str(f) for f in files], **data}
    return load(cfg, gpu_count=0)


def test_jsonl_row_without_the_text_field_is_named_by_file_and_line(tmp_path):
    from distlab.configuration.config import ConfigError

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: no field 'text'"):
        _load_with([path])


def test_empty_file_is_refused_before_any_job(tmp_path):
    from distlab.configuration.config import ConfigError

    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"data\.files\[0\].*empty\.jsonl' is empty"):
        _load_with([path])


def test_non_utf8_text_is_named_with_its_line(tmp_path):
    from distlab.configuration.config import ConfigError

    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond line\nna\u00efve caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{path}:3: not UTF-8"):
        _load_with([path])


def test_json_file_of_json_lines_is_read_as_rows_not_one_document(tmp_path):
    from distlab.data_prep import data

    path = tmp_path / "rows.json"
    path.write_text("".join(json.dumps({"text": f"row {i}", "id": i}) + "\n" for i in range(3)))
    _load_with([path])
    rows = data.load_rows({"source": "files", "files": [str(path)], "text_field": "text"},
                          cache_dir=str(tmp_path / "cache"))
    assert rows["text"] == ["row 0", "row 1", "row 2"]


def test_chat_rows_need_messages_with_an_assistant_turn(tmp_path):
    from distlab.configuration.config import ConfigError

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:1: no assistant message"):
        _load_with([path], format="chat")


def test_experiment_naming_an_unknown_dataset_is_refused():
    from distlab.configuration.config import ConfigError, load

    cfg = tiny_config({"ddp": {"experiments": [{"strategy": "ddp", "dataset": "nope"}]}})
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.dataset': no dataset 'nope'"):
        load(cfg, gpu_count=0)


def test_a_big_json_array_is_checked_in_bounded_memory(tmp_path):
    """The config-time check runs on every snakemake call: a 40 MB JSON array is walked a read
    at a time (json.loads of the whole file grew RSS by ~5x its size)."""
    import json as _json
    import os
    import subprocess
    import sys

    path = tmp_path / "rows.json"
    path.write_text(_json.dumps([{"text": "the quick brown fox " * 4}] * 420_000))
    script = ("import resource, sys\nimport distlab.configuration.config\nfrom distlab.configuration.data_checks "
              "import check_data_file\n"
              "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "check_data_file(sys.argv[1], {'format': 'text', 'text_field': 'text', "
              "'messages_field': 'messages', 'prompt_field': 'prompt', 'response_field': 'response'}, "
              "'data.files[0]')\n"
              "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": repo})
    assert path.stat().st_size > 35e6 and float(out.stdout.split()[-1]) < 40, out.stdout


def test_a_json_line_longer_than_the_row_limit_is_refused_naming_it(tmp_path):
    import json as _json

    from distlab.configuration.config import ConfigError
    from distlab.configuration.data_checks import MAX_ROW_CHARS, check_data_file

    path = tmp_path / "rows.jsonl"
    path.write_text(_json.dumps({"text": "ok"}) + "\n" + _json.dumps({"text": "x" * (MAX_ROW_CHARS + 10)}) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: a JSON line longer than 16 MiB"):
        check_data_file(str(path), {"format": "text", "text_field": "text", "messages_field": "messages",
                                    "prompt_field": "prompt", "response_field": "response"}, "data.files[0]")
