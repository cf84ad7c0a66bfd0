"""Promises about plain-text files: one document, streamed (never read whole), and the
streamed pieces tokenize to the document's own tokens."""
import json
import subprocess
import sys

import pytest

from distlab.data_prep import data

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def _pydoc_text(blank_lines: bool) -> str:
    text = "\n\n".join(t for _, t in data.pydoc_topics())
    return text if blank_lines else "\n".join(line for line in text.split("\n") if line.strip())


def test_plain_text_file_streams_in_pieces_that_keep_the_documents_tokens(prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "TEXT_READ_CHARS", 50_000)  # pieces carried across reads too
    text = _pydoc_text(blank_lines=True)[:200_000]
    path = tmp_path / "book.txt"
    path.write_text(text)
    rows = data.load_rows({"source": "files", "files": [str(path)], "text_field": "text"},
                          cache_dir=str(tmp_path / "cache"))
    pieces = rows["text"]
    assert len(pieces) > 20 and max(map(len, pieces)) < 20_000  # not one row holding the whole file
    assert "".join(pieces) == text and rows["document_end"] == [False] * (len(pieces) - 1) + [True]

    tok = data.load_tokenizer(prepared / "tokenizer")
    data.build_dataset(rows, tok, 32, 0.05, 0, tmp_path / "data", cfg={"text_field": "text"})
    import datasets

    saved = datasets.load_from_disk(str(tmp_path / "data"))
    blocks = sorted((b, ids) for split in saved.values() for b, ids in zip(split["block"], split["input_ids"]))
    stream = [i for _, ids in blocks for i in ids]
    whole = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # one document, one EOS
    assert stream == whole[:len(stream)] and len(whole) - len(stream) < 32


def test_pieces_are_cut_after_a_line_end_with_text_on_both_sides():
    text = "def f():\n    return 1\nx = 2\ny = 3\n"
    assert data.piece_ends(text, target=1, max_chars=100) == [len("def f():\n    return 1\n"),
                                                               len("def f():\n    return 1\nx = 2\n")]
    assert data.piece_ends("a \nb\n  c\n", target=1, max_chars=100) == []  # trailing space, indentation
    assert data.piece_ends("aaaa bbbb\n  cccc dddd", target=1, max_chars=8) == [8, 10, 18]  # forced


@pytest.mark.parametrize("one_line", [False, True])
def test_a_big_text_file_loads_in_flat_memory(tmp_path, one_line):
    """~40 MB of lines and no blank line, or one 40 MB line: loading it grows peak RSS by far
    less than its size (read whole, the text alone would add 40 MB, its Arrow copy another 40)."""
    line_block = _pydoc_text(blank_lines=False)
    if one_line:
        line_block = line_block.replace("\n", " ")
    path = tmp_path / "big.txt"
    with open(path, "w") as fh:
        while fh.tell() < 40e6:
            fh.write(line_block + ("" if one_line else "\n"))
    script = (
        "import json, resource, sys\n"
        "from distlab.data_prep import data\n"
        "import datasets\n"
        "datasets.disable_progress_bars()\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rows = data.load_rows({'source': 'files', 'files': [sys.argv[1]], 'text_field': 'text'}, "
        "cache_dir=sys.argv[2])\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'grew_mb': (peak - base) / 1024, 'rows': len(rows)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "cache")], check=True,
                         capture_output=True, text=True, cwd=REPO, env={**__import__("os").environ,
                                                                        "PYTHONPATH": str(REPO)})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rows"] > 1000 and result["grew_mb"] < 30, result
