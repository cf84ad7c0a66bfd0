"""Data-prep memory and time: the list-based path of faacf6d vs the datasets path, side by side.

    nice -n 10 python benchmarks/data_prep.py --mb 200 --old-mb 20 --out /tmp/dataprep

Generates a JSONL corpus of about --mb MB (rows cut from Python's own documentation, seeded),
trains one 4096-token BPE on python-docs, then prepares the corpus (tokenize, pack seq 128,
split, save Arrow) once per path, each in its own subprocess. Peak RSS is sampled (psutil,
every 0.1 s) as the sum over the process and its children (the datasets path's num_proc
workers are separate processes). The old path holds the corpus as Python lists (~70x the text size), so it runs
on --old-mb (a smaller corpus) unless told otherwise: at 200 MB it needs ~14 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OLD_COMMIT = "faacf6d"

OLD_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("old_data", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
tok = old.load_tokenizer(sys.argv[2])
texts = old.corpus_texts({"source": "files", "files": [sys.argv[3]], "text_field": "text"})
old.build_dataset(texts, tok, 128, 0.05, 0, sys.argv[4])
"""
NEW_SCRIPT = """
import sys
from distlab import data
tok = data.load_tokenizer(sys.argv[1])
cfg = {"source": "files", "files": [sys.argv[2]], "format": "text", "text_field": "text"}
data.build_dataset(data.load_rows(cfg, cache_dir=sys.argv[4]), tok, 128, 0.05, 0, sys.argv[3], cfg=cfg,
                   num_proc=int(sys.argv[5]), cache_dir=sys.argv[4])
"""


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSON lines of 200-2000 character slices of the pydoc pages, ~megabytes in all."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    rng = random.Random(seed)
    target, written, rows = megabytes * 1e6, 0, 0
    with open(path, "w") as fh:
        while written < target:
            start = rng.randrange(0, len(text) - 2000)
            line = json.dumps({"text": text[start:start + rng.randint(200, 2000)]}) + "\n"
            fh.write(line)
            written += len(line)
            rows += 1
    return rows


def measured(cmd: list[str], env: dict) -> dict:
    """Wall time and peak RSS (summed over the process tree, sampled) of one subprocess."""
    import psutil

    start = time.perf_counter()
    # GNU time: user+sys CPU seconds of the process and every child it waited for (the map
    # workers), a figure a machine shared with other jobs distorts less than wall time.
    proc = subprocess.Popen(["/usr/bin/time", "-f", "CPU %U %S"] + cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps, peak_tree = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [ps] + ps.children(recursive=True)
            peak_tree = max(peak_tree, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    wall = time.perf_counter() - start
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{err[-3000:]}")
    user, system = next(line for line in err.splitlines() if line.startswith("CPU ")).split()[1:]
    return {"wall_s": wall, "cpu_s": float(user) + float(system), "peak_rss_tree_bytes": peak_tree}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=200, help="corpus size for the datasets path (MB)")
    parser.add_argument("--old-mb", type=float, default=20, help="corpus size for the old list path (MB)")
    parser.add_argument("--num-proc", type=int, default=2, help="Dataset.map workers (the job's threads)")
    parser.add_argument("--out", default="/tmp/distlab-dataprep-bench")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    sys.path.insert(0, str(REPO))
    from distlab import data

    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        data.train_tokenizer(data.corpus_texts({"source": "python-docs"}), 4096, tok_dir)
    old_module = out / "old_data.py"
    old_module.write_text(subprocess.run(["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:distlab/data.py"],
                                         check=True, capture_output=True, text=True).stdout)
    results = []
    for path_name, megabytes in (("old (faacf6d, Python lists)", args.old_mb),
                                 ("datasets (this branch)", args.old_mb), ("datasets (this branch)", args.mb)):
        corpus = out / f"corpus-{megabytes:g}mb.jsonl"
        if not corpus.is_file():
            make_corpus(corpus, megabytes)
        target = out / f"prepared-{'old' if path_name.startswith('old') else 'new'}-{megabytes:g}mb"
        subprocess.run(["rm", "-rf", str(target), str(target) + ".cache"], check=True)
        os.makedirs(str(target) + ".cache", exist_ok=True)
        if path_name.startswith("old"):
            cmd = [sys.executable, "-c", textwrap.dedent(OLD_SCRIPT), str(old_module), str(tok_dir), str(corpus),
                   str(target)]
        else:
            cmd = [sys.executable, "-c", textwrap.dedent(NEW_SCRIPT), str(tok_dir), str(corpus), str(target),
                   str(target) + ".cache", str(args.num_proc)]
        row = {"path": path_name, "corpus_mb": corpus.stat().st_size / 1e6, **measured(cmd, env)}
        blocks = sum(len(data.load_blocks(target, split)) for split in ("train", "eval"))
        row["blocks"] = blocks
        results.append(row)
        print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n| path | corpus (MB) | wall (s) | CPU user+sys (s) | peak RSS, process tree (GB) | blocks of 128 |")
    print("|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['path']} | {row['corpus_mb']:.0f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
              f"{row['peak_rss_tree_bytes'] / 1e9:.2f} | {row['blocks']:,} |")


if __name__ == "__main__":
    main()
