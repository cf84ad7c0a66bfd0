"""ZeRO-2, ZeRO-3 (auto and memory-lean profiles), FSDP full shard and DDP side by side: the same
model, data, global batch (2 ranks x micro-batch 2 x 2 accumulated, as the default config's
stage 3-4 runs), in interleaved rounds of separate launches.

    python benchmarks/strategy_parity.py [--rounds 3] [--models default,100m] [--steps 8] [--warmup 3]

Each round launches every strategy once through distlab.jobs.launch (fresh processes), in an order
rotated from round to round (and reversed every other round) so drift on a shared machine
hits all of them. Per launch: tokens/s (median step time after warm-up, max over ranks),
the loss per step, and the machine's noise during the timed steps (distlab.runtime.noise: other
processes' CPU, load average). Reported per model and strategy: the median tokens/s over
rounds with its min-max, the ratio to DDP and to FSDP full shard in the same round (median of
the per-round ratios: a ratio is measured side by side, the absolute figures are not), the
largest loss gap to DDP, and how many of its launches ran on a busy machine. Models: the
default config's built model (5.3M) and a ~100M one (hidden 768, 12 layers) built the same way.
Writes results/benchmarks/strategy_parity.json and prints a Markdown table.
"""
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_common import round_order, rounds_parser  # noqa: E402
from distlab.records.job import Job

GLOBAL = {"world_size": 2, "micro_batch": 2, "grad_accum": 2}
STRATEGIES = {
    "DDP": {"strategy": "ddp", "stage": "ddp"},
    "ZeRO-2": {"strategy": "deepspeed", "stage": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "ZeRO-3": {"strategy": "deepspeed", "stage": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "ZeRO-3 lean": {"strategy": "deepspeed", "stage": "deepspeed", "deepspeed": {"zero_stage": 3,
                                                                                 "zero3_profile": "lean"}},
    "FSDP full shard": {"strategy": "fsdp", "stage": "fsdp", "fsdp": {"reshard_after_forward": True}},
}
MODELS = {"default": {}, "100m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                                  "num_key_value_heads": 12, "intermediate_size": 2304}}


def specs(steps: int, warmup: int) -> dict:
    """Each strategy's resolved spec, through the config loader like any experiment."""
    from distlab.configuration.config import load

    cfg = {"stages": {}, "defaults": {"steps": steps, "untimed_steps": warmup, "device": "cpu"}}
    tags = {}
    for name, over in STRATEGIES.items():
        tags[name] = name.lower().replace(" ", "").replace("-", "")
        experiment = {k: v for k, v in over.items() if k != "stage"} | GLOBAL | {"tag": tags[name]}
        cfg["stages"].setdefault(over["stage"], {"experiments": []})["experiments"].append(experiment)
    _, resolved = load(cfg, gpu_count=0)
    return {name: next(s for s in resolved.values() if s["tag"] == tag) for name, tag in tags.items()}


def prepare(root: Path, seq_len: int, models: list[str]) -> tuple[Path, Path, dict]:
    """Tokenizer, data and the models, built with the pipeline's own code."""
    import yaml

    from distlab.data_prep import data
    from distlab.configuration import hardware
    from distlab.runtime import model
    from distlab.configuration.config import load

    cfg, _ = load(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), gpu_count=0)
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tok")
    data.build_dataset(texts, tok, seq_len, cfg["data"]["eval_fraction"], cfg["data"]["seed"], root / "data")
    folders = {}
    for name in models:
        built = model.build_base_model({**cfg["model"]["build"], **MODELS[name]}, tok, root / f"model-{name}")
        folders[name] = (root / f"model-{name}", built["parameters"])
    (root / "hardware.json").write_text(json.dumps(hardware.describe("bench", probe=False)))
    return root / "data", root / "hardware.json", folders


def launch_once(spec: dict, data: Path, model: Path, hw: Path, run_dir: Path) -> dict:
    from distlab.jobs.launch import launch
    from distlab.records.run_outputs import read_run_record

    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(data), model_source=str(model),
              hardware_json=str(hw), env_allowlist=[], checkpoint_dir=None)
    start = time.perf_counter()
    launch(job, log_path=str(run_dir) + ".log", timeout=3600)
    metrics = read_run_record(run_dir / "metrics.json").to_dict()
    return {"tokens_per_s": metrics["throughput"]["tokens_per_s"],
            "median_step_s": metrics["timing"]["step_time_s"]["median"], "losses": metrics["loss"]["per_step"],
            "noise": metrics["noise"], "launch_wall_s": time.perf_counter() - start}


def summarize(launches: dict, rounds: int) -> list[dict]:
    """Per strategy: median tokens/s over rounds, min-max, per-round ratios to DDP and FSDP."""
    rows = []
    for name, runs in launches.items():
        tps = [r["tokens_per_s"] for r in runs]
        row = {"strategy": name, "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
               "tokens_per_s_max": max(tps), "busy_launches": sum(bool(r["noise"].get("busy")) for r in runs),
               "launches": len(runs)}
        for peer in ("DDP", "FSDP full shard"):
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs, launches[peer])]
            row[f"vs {peer}"] = statistics.median(ratios)
            row[f"vs {peer} per round"] = ratios
        ddp = launches["DDP"][0]["losses"]
        row["max_loss_gap_vs_ddp"] = max(abs(a - b) for r in runs for a, b in zip(ddp, r["losses"]))
        rows.append(row)
    return rows


def markdown(model: str, params: int, rows: list[dict]) -> str:
    lines = [f"**{model}** ({params / 1e6:.1f}M parameters)", "",
             "| strategy | tokens/s median (min-max) | vs DDP | vs FSDP full shard | max loss gap vs DDP | "
             "busy launches |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['tokens_per_s_median']:.0f} ({r['tokens_per_s_min']:.0f}-"
                     f"{r['tokens_per_s_max']:.0f}) | {r['vs DDP']:.2f}x | {r['vs FSDP full shard']:.2f}x | "
                     f"{r['max_loss_gap_vs_ddp']:.1e} | {r['busy_launches']} of {r['launches']} |")
    return "\n".join(lines)


def main():
    p = rounds_parser(__doc__, "strategy_parity.json", steps=8, warmup=3)
    p.add_argument("--models", default="default,100m")
    args = p.parse_args()
    models = args.models.split(",")
    by_strategy = specs(args.steps, args.warmup)
    names = list(STRATEGIES)
    result = {"how": __doc__.split("\n\n")[2].strip(), "rounds": args.rounds, "steps": args.steps,
              "warmup": args.warmup, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, hw, folders = prepare(root, by_strategy["DDP"]["seq_len"], models)
        for model in models:
            folder, params = folders[model]
            launches = {name: [] for name in names}
            for r in range(args.rounds):
                for name in round_order(names, r):
                    spec = copy.deepcopy(by_strategy[name])
                    run = launch_once(spec, data, folder, hw, root / "runs" / model / f"r{r}-{spec['id']}")
                    launches[name].append(run)
                    print(f"{model} round {r}: {name} {run['tokens_per_s']:.0f} tok/s "
                          f"({'BUSY' if run['noise'].get('busy') else 'quiet'}, others "
                          f"{run['noise'].get('others_cores')} cores)", flush=True)
            rows = summarize(launches, args.rounds)
            result["models"][model] = {"parameters": params, "rows": rows, "launches": launches}
            print(markdown(model, params, rows), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
