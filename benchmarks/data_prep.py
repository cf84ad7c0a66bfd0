"""Data-prep time and memory: the list-based path of faacf6d vs the datasets path, side by side.

    nice -n 10 python benchmarks/data_prep.py --mb 20 --out /tmp/dataprep           # a few minutes
    nice -n 10 python benchmarks/data_prep.py --mb 20 --new-only-mb 200 --repeat 2   # + the big corpus

Generates a JSONL corpus of about --mb MB (rows cut from Python's own documentation, seeded),
trains one 4096-token BPE on python-docs, then prepares that same corpus (tokenize, pack seq
128, split, save Arrow) with the old path and with the new one, each in its own subprocess,
alternating old/new --repeat times (the order flips every round, so a load change on a shared
machine hits both alike). Per run: wall time, CPU (user+sys of the process and its children,
from GNU time: the figure a shared machine distorts least), peak RSS summed over the process
tree (psutil, every 0.1 s; the num_proc workers are separate processes) and the 1-minute load
average. Then the medians and new/old ratios, and a check that both paths wrote the same
blocks (same ids, same block positions, same train/eval split). --new-only-mb runs the new
path alone on a bigger corpus: the old path holds the corpus as Python lists (~60x the text
size), ~12 GB at 200 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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
from distlab.data_prep import data
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
    """Wall time, CPU and peak RSS (summed over the process tree, sampled) of one subprocess."""
    import psutil

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    # GNU time: user+sys CPU seconds of the process and every child it waited for (the map
    # workers), a figure a machine shared with other jobs distorts less than wall time.
    proc = subprocess.Popen(["/usr/bin/time", "-f", "CPU %U %S"] + cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
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
    return {"wall_s": wall, "cpu_s": float(user) + float(system), "peak_rss_tree_bytes": peak_tree,
            "load_1min": round((load_before + os.getloadavg()[0]) / 2, 1)}


def prepared_blocks(path: Path) -> dict:
    """Every block of a prepared folder by split: block positions and ids, as numpy."""
    import datasets
    import numpy as np

    saved = datasets.load_from_disk(str(path))
    out = {}
    for split in ("train", "eval"):
        part = saved[split].with_format("numpy")
        out[split] = (np.asarray(part["block"]), np.stack(part["input_ids"]).astype(np.int64))
    return out


def same_blocks(a: Path, b: Path) -> bool:
    import numpy as np

    left, right = prepared_blocks(a), prepared_blocks(b)
    return all(np.array_equal(left[s][0], right[s][0]) and np.array_equal(left[s][1], right[s][1])
               for s in ("train", "eval"))


def run_path(kind: str, corpus: Path, out: Path, tok_dir: Path, old_module: Path, num_proc: int, env: dict) -> dict:
    megabytes = corpus.stat().st_size / 1e6
    target = out / f"prepared-{kind}-{corpus.stem}"
    subprocess.run(["rm", "-rf", str(target), str(target) + ".cache"], check=True)
    os.makedirs(str(target) + ".cache", exist_ok=True)
    if kind == "old":
        cmd = [sys.executable, "-c", textwrap.dedent(OLD_SCRIPT), str(old_module), str(tok_dir), str(corpus),
               str(target)]
    else:
        cmd = [sys.executable, "-c", textwrap.dedent(NEW_SCRIPT), str(tok_dir), str(corpus), str(target),
               str(target) + ".cache", str(num_proc)]
    row = {"path": kind, "corpus_mb": megabytes, **measured(cmd, env), "prepared": str(target)}
    row["blocks"] = sum(len(v[0]) for v in prepared_blocks(target).values())
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20, help="corpus size both paths prepare (MB)")
    parser.add_argument("--new-only-mb", type=float, nargs="*", default=[],
                        help="bigger corpora for the new path alone (MB)")
    parser.add_argument("--repeat", type=int, default=1, help="old/new rounds on the --mb corpus")
    parser.add_argument("--num-proc", type=int, default=2, help="Dataset.map workers (the job's threads)")
    parser.add_argument("--out", default="/tmp/distlab-dataprep-bench")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    sys.path.insert(0, str(REPO))
    from distlab.data_prep import data

    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        data.train_tokenizer(data.corpus_texts({"source": "python-docs"}), 4096, tok_dir)
    old_module = out / "old_data.py"
    old_module.write_text(subprocess.run(["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:distlab/data_prep/data.py"],
                                         check=True, capture_output=True, text=True).stdout)
    corpora = {}
    for megabytes in [args.mb, *args.new_only_mb]:
        corpora[megabytes] = out / f"corpus-{megabytes:g}mb.jsonl"
        if not corpora[megabytes].is_file():
            make_corpus(corpora[megabytes], megabytes)
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()}", flush=True)
    results = []
    for round_no in range(args.repeat):
        for kind in (("old", "new") if round_no % 2 == 0 else ("new", "old")):
            results.append(run_path(kind, corpora[args.mb], out, tok_dir, old_module, args.num_proc, env))
    identical = same_blocks(Path(results[0]["prepared"]), Path(results[1]["prepared"]))
    for megabytes in args.new_only_mb:
        results.append(run_path("new", corpora[megabytes], out, tok_dir, old_module, args.num_proc, env))
    summary = {}
    for kind in ("old", "new"):
        runs = [r for r in results if r["path"] == kind and r["corpus_mb"] == results[0]["corpus_mb"]]
        summary[kind] = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s", "peak_rss_tree_bytes")}
    ratio = {k: summary["new"][k] / summary["old"][k] for k in summary["new"]}
    (out / "results.json").write_text(json.dumps({"runs": results, "median": summary, "new_over_old": ratio,
                                                  "same_blocks": identical, "num_proc": args.num_proc}, indent=1))
    names = {"old": f"old ({OLD_COMMIT}, Python lists)", "new": f"datasets (num_proc {args.num_proc})"}
    print("\n| path | corpus (MB) | wall (s) | CPU user+sys (s) | peak RSS, process tree (GB) | load avg | "
          "blocks of 128 |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {names[row['path']]} | {row['corpus_mb']:.0f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
              f"{row['peak_rss_tree_bytes'] / 1e9:.2f} | {row['load_1min']:.1f} | {row['blocks']:,} |")
    print(f"\nmedian over {args.repeat} round(s) at {results[0]['corpus_mb']:.0f} MB, new/old: "
          f"wall {ratio['wall_s']:.2f}, CPU {ratio['cpu_s']:.2f}, peak RSS {ratio['peak_rss_tree_bytes']:.2f}")
    print(f"same blocks from both paths (ids, positions, train/eval split): {identical}")
    if not identical:
        raise SystemExit("the two paths prepared different blocks")


if __name__ == "__main__":
    main()
