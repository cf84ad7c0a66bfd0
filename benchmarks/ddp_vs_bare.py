"""distlab's DDP step throughput vs a bare hand-written torchrun DDP loop, side by side.

    python benchmarks/ddp_vs_bare.py [--rounds 3] [--world 2] [--steps 30]

Same model (the default config's base model, built here if results/prep has none), same
data, batch, threads and step timing. Runs alternate A B, B A, ... so drift on a shared
machine hits both; the ratio is median(distlab tokens/s) / median(bare tokens/s).
Writes results/benchmarks/ddp_vs_bare.json. Goal: ratio >= 0.97.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from distlab.records.job import Job
from distlab.records.spec import Spec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def prepared(root: Path, seq_len: int) -> tuple[Path, Path, Path]:
    """tokenizer, data and model from the default config, built with the pipeline's code."""
    import yaml

    from distlab.data_prep import data
    from distlab.configuration import hardware
    from distlab.runtime import model
    from distlab.configuration.config import load

    cfg, _ = load(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), gpu_count=0)
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tok")
    data.build_dataset(texts, tok, seq_len, cfg["data"]["eval_fraction"], cfg["data"]["seed"], root / "data")
    model.build_base_model(cfg["model"]["build"], tok, root / "model")
    (root / "hardware.json").write_text(json.dumps(hardware.describe("bench", probe=False)))
    return root / "data", root / "model", root / "hardware.json"


def run_distlab(spec, data, model, hw, run_dir):
    from distlab.jobs.launch import launch
    from distlab.records.run_outputs import read_run_record

    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(data), model_source=str(model),
              hardware_json=str(hw), env_allowlist=[], checkpoint_dir=None)
    launch(job, log_path=str(run_dir) + ".log", timeout=600)
    return read_run_record(run_dir / "metrics.json").data["throughput"]["tokens_per_s"]


def run_bare(args, data, model, out):
    from distlab.launchers import loopback
    from distlab.launchers.torchrun import torchrun_script_command

    # The bare loop's launch is distlab's, loopback only (a plain torchrun listens on every interface).
    cmd = torchrun_script_command(args.world, REPO / "benchmarks" / "bare_ddp.py",
                                  "--model", str(model), "--data", str(data), "--micro-batch", str(args.micro_batch),
                                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), **loopback.environment())
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["tokens_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    from distlab.configuration.config import EXPERIMENT_DEFAULTS, experiment_id

    spec = Spec(dict(EXPERIMENT_DEFAULTS, world_size=args.world, micro_batch=args.micro_batch, steps=args.steps,
                     untimed_steps=args.warmup, device="cpu", launcher="torchrun", stage="ddp"))
    spec = spec.replace(id=experiment_id(spec))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, model, hw = prepared(root, spec["seq_len"])
        ours, bare = [], []
        for r in range(args.rounds):
            # A B, then B A: neither side always runs first (warm caches, drifting load).
            runs = [lambda: ours.append(run_distlab(spec, data, model, hw, root / f"distlab{r}")),
                    lambda: bare.append(run_bare(args, data, model, root / f"bare{r}.json"))]
            for run in (runs if r % 2 == 0 else runs[::-1]):
                run()
            print(f"round {r}: distlab {ours[-1]:.0f} tok/s, bare {bare[-1]:.0f} tok/s", flush=True)
    result = {"distlab_tokens_per_s": ours, "bare_tokens_per_s": bare,
              "ratio_of_medians": statistics.median(ours) / statistics.median(bare),
              "ratio_per_round": [a / b for a, b in zip(ours, bare)],
              "how": f"{args.rounds} alternating rounds; each run {args.steps} steps, median step time after "
                     f"{args.warmup} warm-up steps (max over {args.world} gloo ranks, 1 thread each)"}
    out = REPO / "results" / "benchmarks" / "ddp_vs_bare.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
