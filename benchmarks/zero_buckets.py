"""ZeRO-3 step time by gradient reduce bucket size, side by side in one run: distlab's sizing
(strategies/deepspeed_config.gradient_bucket_size), one decoder layer per bucket, and
DeepSpeed's 5e8 default, on the tests' tiny Llama (full fine-tuning, 2 ranks over gloo,
micro-batch 2 x 2 accumulated, 20 steps, 3 warm-up). Rounds are interleaved.

    nice -n 10 python benchmarks/zero_buckets.py [--rounds 2] [--out results/benchmarks/zero_buckets.json]

Smaller buckets mean more collectives; on a CPU run the 5e8 bucket costs no memory (its pages
are never touched), on a GPU it is 2 GB (fp32) of device memory per rank.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def prepare(root: Path) -> int:
    """The tests' tiny workspace (distlab.testing.build_prepared); returns one decoder layer's parameters."""
    from distlab.testing import build_prepared
    from distlab.runtime import model

    build_prepared(root)
    built = model.load_model(str(root / "model"))
    return sum(p.numel() for p in model.decoder_layers(built)[0].parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "zero_buckets.json"))
    args = parser.parse_args()
    from distlab.testing import resolve, run_experiment

    os.environ.setdefault("PYTHONPATH", str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        layer = prepare(root)
        variants = {"distlab": None, "one layer": layer, "deepspeed 5e8": 500_000_000}
        medians = {label: [] for label in variants}
        for round_index in range(args.rounds):
            for label, size in variants.items():
                ds = {"zero_stage": 3, **({"zero_config": {"reduce_bucket_size": size}} if size else {})}
                spec = resolve({"strategy": "deepspeed", "world_size": 2, "micro_batch": 2, "grad_accum": 2,
                                "steps": 20, "untimed_steps": 3, "deepspeed": ds}, stage="deepspeed")
                run_dir = root / "runs" / f"{label.replace(' ', '-')}-{round_index}"
                metrics = run_experiment(root, run_dir, spec, checkpoint=False)
                used = json.loads((run_dir / metrics["as_built"]["deepspeed"]["config_path"]).read_text())
                medians[label].append(metrics["timing"]["step_time_s"]["median"])
                print(f"round {round_index} {label:14} bucket {used['zero_optimization'].get('reduce_bucket_size')}"
                      f" median step {medians[label][-1]:.4f} s", flush=True)
    base = statistics.median(medians["deepspeed 5e8"])
    print(f"one decoder layer: {layer} parameters")
    for label, values in medians.items():
        print(f"{label:14} median of round medians {statistics.median(values):.4f} s "
              f"(range {min(values):.4f}-{max(values):.4f}), {statistics.median(values) / base:.2f}x DeepSpeed's "
              "default")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"layer_params": layer, "median_step_s": medians}, indent=1))


if __name__ == "__main__":
    main()
