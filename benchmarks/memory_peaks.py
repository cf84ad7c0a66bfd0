"""Per-rank load-phase and training-phase memory peaks per strategy, on a Llama built here
(hidden 1024, 24 layers: 305M parameters, the model of tests/test_memory_sharded.py; LoRA,
seq 32, 2 steps): what sharded loading and training save against one DDP rank.

    nice -n 10 python benchmarks/memory_peaks.py [--layers 24] [--out results/benchmarks/memory_peaks.json]

--layers 12 gives the 155M model of earlier figures: with fewer, larger layers the gathered
layers are a larger share of a sharded rank's training peak.

Each run goes through the real launcher (distlab.launch, torchrun ranks over gloo). Figures
per rank, from metrics.json (distlab.memory): the RSS before the model (interpreter,
libraries, process group), the load-phase peak (VmHWM from process start to step 0) and
the training-phase peak (VmHWM of the steps alone), each also minus the RSS before the
model ("model part"). One round: peaks are high-water marks, not timings.
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

MIB = 2**20
LORA = {"method": "lora", "steps": 2, "untimed_steps": 1}
RUNS = {
    "ddp w1": ({"strategy": "ddp", "world_size": 1, "micro_batch": 2}, "ddp"),
    "zero0 w1": ({"strategy": "deepspeed", "world_size": 1, "micro_batch": 2, "deepspeed": {"zero_stage": 0}},
                 "deepspeed"),
    "fsdp w2": ({"strategy": "fsdp", "world_size": 2, "micro_batch": 1}, "fsdp"),
    "zero3 w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1, "deepspeed": {"zero_stage": 3}},
                 "deepspeed"),
    # ZeRO-3 with DeepSpeed's own live-parameter defaults instead of distlab's layer-sized
    # limits (strategies/deepspeed_config.zero3_live_limits): what those limits save.
    "zero3 ds-live w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1, "deepspeed": {
        "zero_stage": 3, "zero_config": {"stage3_max_live_parameters": 1_000_000_000,
                                         "stage3_max_reuse_distance": 1_000_000_000,
                                         "stage3_prefetch_bucket_size": 50_000_000}}}, "deepspeed"),
    "zero3+offload w2": ({"strategy": "deepspeed", "world_size": 2, "micro_batch": 1,
                          "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}},
                         "deepspeed"),
}


def prepare(root: Path, layers: int) -> int:
    """The tests' tiny tokenizer and data (seq 32), and the big model, built with the pipeline's code."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import tiny_config
    from distlab import data, hardware, model
    from distlab.config import validate_schema

    cfg = validate_schema(tiny_config({}))
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tokenizer")
    data.build_dataset(texts, tok, 32, 0.05, 0, root / "data32")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers of the model (hidden 1024)")
    parser.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "memory_peaks.json"))
    args = parser.parse_args()
    from conftest import resolve, run_experiment

    os.environ.setdefault("PYTHONPATH", str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_params = prepare(root, args.layers)
        rows = []
        for label, (overrides, stage) in RUNS.items():
            metrics = run_experiment(root, root / "runs" / label.replace(" ", "-"),
                                     resolve({**overrides, **LORA}, stage=stage), checkpoint=False)
            for index, rank in enumerate(metrics["memory"]["per_rank"]):
                before = rank["load_phase"]["rss_before_model_bytes"]
                load, train = rank["load_phase"]["rss_peak_bytes"], rank["training_phase"]["rss_peak_bytes"]
                rows.append({"run": label, "rank": index, "before_model_mib": before / MIB,
                             "load_peak_mib": load / MIB, "training_peak_mib": train / MIB,
                             "load_model_part_mib": (load - before) / MIB,
                             "training_model_part_mib": (train - before) / MIB,
                             "first_loss": metrics["loss"]["first"]})
    ddp = next(r for r in rows if r["run"] == "ddp w1")
    print(f"model: {n_params / 1e6:.1f}M parameters, {args.layers} layers, LoRA, seq 32; MiB per rank")
    print(f"{'run':18} rank  before  load  train  load-part  train-part  vs DDP (load/train part)")
    for r in rows:
        print(f"{r['run']:18} {r['rank']:4} {r['before_model_mib']:7.0f} {r['load_peak_mib']:5.0f} "
              f"{r['training_peak_mib']:6.0f} {r['load_model_part_mib']:10.0f} {r['training_model_part_mib']:11.0f}  "
              f"{r['load_model_part_mib'] / ddp['load_model_part_mib']:.2f} / "
              f"{r['training_model_part_mib'] / ddp['training_model_part_mib']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"parameters": n_params, "layers": args.layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
