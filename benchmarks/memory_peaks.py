"""Per-rank load-, training- and save-phase memory peaks per strategy, and the bytes each
final checkpoint writes, on a Llama built here (hidden 1024, 24 layers: 309M parameters, the
model of tests/test_memory_sharded.py; LoRA, seq 32, 2 steps): what sharded loading, training
and saving hold against one DDP rank.

    nice -n 10 python benchmarks/memory_peaks.py [--layers 24] [--full] [--rounds 1] [--runs "ddp w1,fsdp w2"]
                                                 [--out results/benchmarks/memory_peaks.json]

--layers 12 gives the 155M model of earlier figures: with fewer, larger layers the gathered
layers are a larger share of a sharded rank's training peak. --full adds full fine-tuning:
DDP at 1 and 2 ranks (16 bytes per parameter: ~7 GB of RAM per rank at 309M), FSDP and ZeRO-3
at 2 ranks.

Each run goes through the real launcher (distlab.jobs.launch, torchrun ranks over gloo) and saves
its final checkpoint and export. Figures per rank, from metrics.json (distlab.runtime.memory): the
RSS before the model (interpreter, libraries, process group), the load-phase peak (VmHWM from
process start to step 0), the training-phase peak (VmHWM of the steps alone), the save-phase
peak (VmHWM of the final evaluation, save and export alone), the lifetime peak (the largest),
"save - train" against one decoder layer's fp32 bytes (what the streamed export may add), and
the final checkpoint's bytes on disk (state, trainer state, export, recorded logits) and, for
LoRA runs (checkpoint_every: 1), the periodic one saved after step 1 (state and trainer state).
--rounds N launches every selected run N times, interleaved (bench_common.round_order), and
prints each figure's median and range over the rounds. The data keep 2 held-out blocks
(data.eval_blocks): the final evaluation's micro-batches are as large as training's, so its
peak does not depend on how many there are, and a sharded rank gathers every layer for each.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 2**20
LORA = {"method": "lora", "steps": 2, "untimed_steps": 1, "checkpoint_every": 1}
FULL = {"method": "full", "steps": 2, "untimed_steps": 1}
FULL_RUNS = {
    "full ddp w1": ({"strategy": "ddp", "world_size": 1, "micro_batch": 2}, "ddp"),
    # Left out of tests/test_memory_sharded.py: ~14 GB of RAM for its two replicas (16 bytes per
    # parameter each, plus DDP's gradient buckets), more than CI's machine can spare beside a test.
    "full ddp w2": ({"strategy": "ddp", "world_size": 2, "micro_batch": 1}, "ddp"),
    "full fsdp w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 1}, "fsdp"),
    "full zero3 w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1, "deepspeed": {"zero_stage": 3}},
                      "deepspeed"),
}
RUNS = {
    "ddp w1": ({"strategy": "ddp", "world_size": 1, "micro_batch": 2}, "ddp"),
    "zero0 w1": ({"strategy": "deepspeed", "world_size": 1, "micro_batch": 2, "deepspeed": {"zero_stage": 0}},
                 "deepspeed"),
    "fsdp w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 1}, "fsdp"),
    "zero3 w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1,
                  "deepspeed": {"zero_stage": 3, "zero3_profile": "lean"}}, "deepspeed"),
    # The auto profile (Hugging Face's auto sizes, DeepSpeed's 1e9 live limits) instead of the
    # lean one (strategies/deepspeed_config.zero3_limits): what the lean limits save.
    "zero3 auto w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1, "deepspeed": {"zero_stage": 3}},
                      "deepspeed"),
    "zero3+offload w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1,
                          "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}},
                         "deepspeed"),
}


def prepare(root: Path, layers: int) -> int:
    """The tests' tiny tokenizer and data (seq 32), and the big model, built with the pipeline's code."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distlab.data_prep import data
    from distlab.configuration import hardware
    from distlab.runtime import model
    from distlab.configuration.config import validate_schema
    from distlab.testing import tiny_config

    cfg = validate_schema(tiny_config({}))
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tokenizer")
    data.build_dataset(texts, tok, 32, 0.05, 0, root / "data32", cfg={"eval_blocks": 2})
    model.build_base_model(cfg["model"]["build"], tok, root / "tiny-model")
    config = AutoConfig.from_pretrained(root / "tiny-model")
    config.update({"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": layers,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64})
    torch.manual_seed(0)
    big = AutoModelForCausalLM.from_config(config)
    big.save_pretrained(root / "model")
    tok.save_pretrained(str(root / "model"))
    info = hardware.describe("benchmark", probe=False)
    info["cpu_peak"] = {"per_thread": hardware.measure_cpu_matmul_peak(1, size=256, seconds=0.2)}
    (root / "hardware.json").write_text(json.dumps(info))
    return sum(p.numel() for p in big.parameters())


FIGURES = ("before_model_mib", "load_peak_mib", "training_peak_mib", "save_peak_mib", "lifetime_peak_mib",
           "save_minus_training_mib", "checkpoint_mb", "periodic_checkpoint_mb")


def rank_rows(label: str, round_index: int, metrics: dict) -> list[dict]:
    """One row per rank of one run: its phase peaks and the run's checkpoint bytes."""
    periodic = [save["bytes"] for save in metrics["checkpoint"].get("periodic_saves") or [] if save.get("bytes")]
    rows = []
    for index, rank in enumerate(metrics["memory"]["per_rank"]):
        before = rank["load_phase"]["rss_before_model_bytes"]
        load, train = rank["load_phase"]["rss_peak_bytes"], rank["training_phase"]["rss_peak_bytes"]
        save = rank["save_phase"]["rss_peak_bytes"]
        rows.append({"run": label, "round": round_index, "rank": index, "before_model_mib": before / MIB,
                     "load_peak_mib": load / MIB, "training_peak_mib": train / MIB,
                     "save_peak_mib": save / MIB, "lifetime_peak_mib": rank["peak_through_save_bytes"] / MIB,
                     "save_minus_training_mib": (save - train) / MIB,
                     "load_model_part_mib": (load - before) / MIB,
                     "training_model_part_mib": (train - before) / MIB,
                     "checkpoint_mb": metrics["checkpoint"]["bytes"] / 1e6,
                     "periodic_checkpoint_mb": periodic[-1] / 1e6 if periodic else None,
                     "first_loss": metrics["loss"]["first"]})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per run and rank: each figure's median and range over the rounds."""
    out = []
    for key in dict.fromkeys((r["run"], r["rank"]) for r in rows):
        mine = [r for r in rows if (r["run"], r["rank"]) == key]
        entry = {"run": key[0], "rank": key[1], "rounds": len(mine)}
        for name in FIGURES + ("load_model_part_mib", "training_model_part_mib"):
            values = [r[name] for r in mine if r[name] is not None]
            entry[name] = ({"median": statistics.median(values), "min": min(values), "max": max(values)}
                           if values else None)
        out.append(entry)
    return out


def cell(figure: dict | None, digits: int = 0) -> str:
    if figure is None:
        return "-"
    text, low, high = (f"{figure[k]:.{digits}f}" for k in ("median", "min", "max"))
    return text if low == high else f"{text} ({low} to {high})"


def main() -> None:
    from bench_common import round_order

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of the model (hidden 1024)")
    parser.add_argument("--full", action="store_true", help="also full fine-tuning (DDP w1 and w2, FSDP w2, ZeRO-3 w2)")
    parser.add_argument("--rounds", type=int, default=1, help="independent launches of every selected run")
    parser.add_argument("--runs", default=None, help="comma-separated run labels (default: all), e.g. 'ddp w1,fsdp w2'")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "memory_peaks.json"))
    args = parser.parse_args()
    from distlab.testing import resolve, run_experiment

    runs = {**{k: ({**o, **LORA}, st) for k, (o, st) in RUNS.items()},
            **({k: ({**o, **FULL}, st) for k, (o, st) in FULL_RUNS.items()} if args.full else {})}
    if args.runs:
        chosen = [label.strip() for label in args.runs.split(",")]
        unknown = [label for label in chosen if label not in runs]
        if unknown:
            parser.error(f"--runs: unknown run(s) {unknown}; known: {sorted(runs)}")
        runs = {label: runs[label] for label in chosen}
    os.environ.setdefault("PYTHONPATH", str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_params = prepare(root, args.layers)
        layer = layer_fp32_bytes(root / "model")
        rows = []
        for round_index in range(args.rounds):
            for label in round_order(list(runs), round_index):
                overrides, stage = runs[label]
                run_dir = root / "runs" / f"{label.replace(' ', '-')}-{round_index}"
                rows += rank_rows(label, round_index, run_experiment(root, run_dir, resolve(overrides, stage=stage)))
                shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)  # measured; a full one is GBs
    summary = summarize(rows)
    ddp = next((r for r in summary if r["run"] == "ddp w1"), None)
    print(f"model: {n_params / 1e6:.1f}M parameters, {args.layers} layers, seq 32; one decoder layer in fp32 "
          f"{layer / MIB:.0f} MiB; MiB per rank, median (range) over {args.rounds} round(s)")
    print("| run | rank | before model | load peak | training peak | save peak | lifetime peak | save - training | "
          "load/train part vs DDP w1 | final checkpoint MB | periodic checkpoint MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        parts = ("load_model_part_mib", "training_model_part_mib")
        versus = "-" if ddp is None else " / ".join(f"{r[p]['median'] / ddp[p]['median']:.2f}" for p in parts)
        print(f"| {r['run']} | {r['rank']} | " + " | ".join(cell(r[name]) for name in FIGURES[:6])
              + f" | {versus} | {cell(r['checkpoint_mb'], 1)} | {cell(r['periodic_checkpoint_mb'], 1)} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"parameters": n_params, "layers": args.layers, "rounds": args.rounds,
                                          "layer_fp32_bytes": layer, "summary": summary, "rows": rows}, indent=1))


def layer_fp32_bytes(model_dir: Path) -> int:
    from distlab.runtime.parameter_counts import model_shape, parameter_counts

    return 4 * parameter_counts(model_shape(json.loads((model_dir / "config.json").read_text())))["per_layer"]


if __name__ == "__main__":
    main()
