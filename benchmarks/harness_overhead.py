"""Where a training job's wall time goes: the fixed costs around its timed steps.

    python benchmarks/harness_overhead.py [--experiments ID,ID,...] [--rounds 1]

Runs experiments of the default config as the pipeline does (distlab.launch, checkpoint on,
base-model eval file given), then their checkpoint validation (distlab.validate.validate_run),
on the default config's own prepared data and model (built here). Per job: the launch's wall
time; from rank 0's timeline (metrics.json `timeline`, distlab.timeline) the interpreter and
imports, process group, model load/wrap/verify, data and resume, the steps, gathering the
records, the held-out eval, the final save and export; the rest of the launch's wall
("launcher and teardown": the launcher process's own start, torchrun or accelerate launch,
the ranks' exit) and the validation job's wall. Prints a Markdown table and the share of
wall time spent in steps; writes results/benchmarks/harness_overhead.json. The machine's
noise during each run's steps (distlab.noise) is printed beside it.
"""
import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT = ("ddp-full-w1-mb8-ga1,ddp-full-w2-mb4-ga1,accelerate-lora-w2-mb4-ga1,deepspeed-z3-full-w2-mb2-ga2,"
           "fsdp-fullshard-full-w2-mb2-ga2")


def prepare(root: Path) -> tuple[dict, dict, Path]:
    """The default config's specs; its data, model, base eval and hardware.json built here."""
    import yaml

    from distlab import data, evaluation, hardware, model
    from distlab.config import load

    cfg, specs = load(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), gpu_count=0)
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tok")
    data.build_dataset(texts, tok, cfg["defaults"]["seq_len"], cfg["data"]["eval_fraction"], cfg["data"]["seed"],
                       root / "data")
    model.build_base_model(cfg["model"]["build"], tok, root / "model")
    evaluation.evaluate_base(str(root / "model"), root / "data", root / "base_eval.json")
    (root / "hardware.json").write_text(json.dumps(hardware.describe("bench", probe=False)))
    return cfg, specs, root


def run_job(spec: dict, root: Path, run_dir: Path) -> dict:
    from distlab.launch import launch
    from distlab.run_outputs import read_run_record
    from distlab.validate import validate_run

    job = {"spec": spec, "run_dir": str(run_dir), "data_dir": str(root / "data"), "model_source": str(root / "model"),
           "hardware_json": str(root / "hardware.json"), "env_allowlist": [],
           "checkpoint_dir": str(run_dir / "checkpoint"), "base_eval_json": str(root / "base_eval.json")}
    start = time.perf_counter()
    launch(job, log_path=str(run_dir) + ".log", timeout=1800)
    wall = time.perf_counter() - start
    metrics = read_run_record(run_dir / "metrics.json").to_dict()
    start = time.perf_counter()
    validation = validate_run(run_dir, str(root / "model"), str(root / "data"), run_dir / "validation.json",
                              log_path=str(run_dir) + "-validate.log")
    phases = {p["phase"]: p["wall_s"] for p in metrics["timeline"]["phases"]}
    ranks_end = metrics["timeline"]["phases"][-1]["end_s"]
    return {"experiment": spec["id"], "job_wall_s": wall, "phases": phases,
            "launcher_and_teardown_s": wall - ranks_end, "validation_wall_s": time.perf_counter() - start,
            "validation": validation["status"], "noise": metrics["noise"]}


def table(rows: list[dict]) -> str:
    phases = list(rows[0]["phases"])
    head = ["experiment", "job wall", *phases, "launcher + teardown", "steps share", "validation job", "machine"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["experiment"], f"{r['job_wall_s']:.1f}", *(f"{r['phases'].get(p, 0):.1f}" for p in phases),
                 f"{r['launcher_and_teardown_s']:.1f}", f"{r['phases'].get('steps', 0) / r['job_wall_s']:.0%}",
                 f"{r['validation_wall_s']:.1f}", "BUSY" if r["noise"].get("busy") else "quiet"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", default=DEFAULT)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "harness_overhead.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _, specs, root = prepare(Path(tmp))
        for r in range(args.rounds):
            for exp in args.experiments.split(","):
                rows.append(run_job(copy.deepcopy(specs[exp]), root, root / "runs" / f"r{r}" / exp))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "noise"}), flush=True)
    total = sum(r["job_wall_s"] + r["validation_wall_s"] for r in rows)
    steps = sum(r["phases"].get("steps", 0) for r in rows)
    summary = {"jobs": len(rows), "train_and_validation_wall_s": total, "steps_s": steps,
               "steps_share": steps / total,
               "median_fixed_cost_per_training_job_s": statistics.median(
                   r["job_wall_s"] - r["phases"].get("steps", 0) for r in rows),
               "median_validation_job_s": statistics.median(r["validation_wall_s"] for r in rows)}
    print(table(rows))
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "how": __doc__.split("\n\n")[2].strip()}, indent=1))


if __name__ == "__main__":
    main()
