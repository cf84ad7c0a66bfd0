"""distlab's DDP step time vs transformers.Trainer on the same work, at 1 and 2 ranks, and what
a fixed glibc mmap threshold costs (distlab.runtime.host_allocator: fixed at 2 MiB only where a layer
weight reaches it; the default model's layers are smaller, so as shipped it runs under glibc's).

    python benchmarks/trainer_parity.py [--rounds 3] [--worlds 1,2] [--steps 30] [--warmup 5]

Arms, each a separate launch per round, in an order rotated every round (reversed every other):
  distlab            the pipeline's DDP (distlab.jobs.launch), as shipped (the threshold its model calls for)
  distlab-2MiB       the same with DISTLAB_MMAP_THRESHOLD=2097152 (every CPU rank until 2026-12-06)
  distlab-1MiB       the same with DISTLAB_MMAP_THRESHOLD=1048576 (the threshold before 2026-12-03)
  distlab-dynamic    the same with DISTLAB_MMAP_THRESHOLD=0 (glibc's dynamic threshold)
  trainer            benchmarks/trainer_run.py under torchrun: Trainer, glibc's dynamic threshold
  trainer-1MiB       the same with MALLOC_MMAP_THRESHOLD_=1048576 (glibc's own tunable)
Same model (the default config's built model), data, batch order, micro-batch (8 at 1 rank,
4 at 2: global batch 8), one thread per rank, AdamW, no clipping. Per round, the ratio of each
arm's median step time to Trainer's in the same round; reported: the median of those ratios
and their range, with each launch's machine noise (distlab.runtime.noise for distlab's runs; the load
average for Trainer's). Also the largest loss gap between distlab and Trainer (same work:
expected ~1e-6). Writes results/benchmarks/trainer_parity.json.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_common import round_order, rounds_parser  # noqa: E402
from ddp_vs_bare import prepared  # noqa: E402  (the default config's data and model, built here)
from distlab.records.job import Job
from distlab.records.spec import Spec

ARMS = ("distlab", "distlab-2MiB", "distlab-1MiB", "distlab-dynamic", "trainer", "trainer-1MiB")
THRESHOLDS = {"distlab-2MiB": 2 << 20, "distlab-1MiB": 1 << 20, "distlab-dynamic": 0}  # DISTLAB_MMAP_THRESHOLD per arm


def run_distlab(spec, data, model, hw, run_dir, threshold: int | None) -> dict:
    """One distlab launch; threshold: DISTLAB_MMAP_THRESHOLD (None: as shipped)."""
    from distlab.jobs.launch import launch
    from distlab.records.run_outputs import read_run_record

    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(data), model_source=str(model),
              hardware_json=str(hw), env_allowlist=[], checkpoint_dir=None)
    saved = os.environ.pop("DISTLAB_MMAP_THRESHOLD", None)
    if threshold is not None:
        os.environ["DISTLAB_MMAP_THRESHOLD"] = str(threshold)
    try:
        launch(job, log_path=str(run_dir) + ".log", timeout=1200)
    finally:
        os.environ.pop("DISTLAB_MMAP_THRESHOLD", None)
        if saved is not None:
            os.environ["DISTLAB_MMAP_THRESHOLD"] = saved
    m = read_run_record(run_dir / "metrics.json").to_dict()
    return {"median_step_s": m["timing"]["step_time_s"]["median"], "losses": m["loss"]["per_step"],
            "noise": m["noise"]}


def run_trainer(world, micro_batch, args, data, model, out: Path, fixed: bool) -> dict:
    from distlab.launchers import loopback
    from distlab.launchers.torchrun import torchrun_script_command

    # Launched as distlab launches its ranks, loopback only (a plain torchrun listens on every interface).
    cmd = torchrun_script_command(world, REPO / "benchmarks" / "trainer_run.py", "--model", str(model),
                                  "--data", str(data), "--micro-batch", str(micro_batch), "--steps", str(args.steps),
                                  "--warmup", str(args.warmup), "--out", str(out))
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **loopback.environment())
    if fixed:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    load = os.getloadavg()[0]
    with open(str(out) + ".log", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    result = json.loads(out.read_text())
    result["noise"] = {"load_avg_1min": [load, os.getloadavg()[0]]}
    return result


def main():
    p = rounds_parser(__doc__, "trainer_parity.json", steps=30, warmup=5)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--arms", default=",".join(ARMS))
    args = p.parse_args()
    from distlab.configuration.config import EXPERIMENT_DEFAULTS, experiment_id

    arms = args.arms.split(",")
    result = {"how": __doc__.split("\n\n")[1].strip(), "worlds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, model, hw = prepared(root, EXPERIMENT_DEFAULTS["seq_len"])
        for world in (int(w) for w in args.worlds.split(",")):
            micro = 8 // world
            spec = Spec(dict(EXPERIMENT_DEFAULTS, world_size=world, micro_batch=micro, steps=args.steps,
                             untimed_steps=args.warmup, device="cpu", launcher="torchrun", stage="ddp"))
            spec = spec.replace(id=experiment_id(spec))
            runs = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm in round_order(arms, r):
                    where = root / f"w{world}-r{r}-{arm}"
                    if arm.startswith("distlab"):
                        run = run_distlab(spec, data, model, hw, where, THRESHOLDS.get(arm))
                    else:
                        run = run_trainer(world, micro, args, data, model, Path(str(where) + ".json"),
                                          fixed=arm == "trainer-1MiB")
                    runs[arm].append(run)
                    print(f"w{world} round {r} {arm}: {run['median_step_s'] * 1000:.1f} ms/step "
                          f"(noise {run['noise']})", flush=True)
            summary = {}
            for arm in arms:
                ratios = [a["median_step_s"] / b["median_step_s"] for a, b in zip(runs[arm], runs["trainer"])]
                summary[arm] = {"median_step_s": statistics.median(x["median_step_s"] for x in runs[arm]),
                                "step_vs_trainer_median": statistics.median(ratios), "per_round": ratios}
            gap = max(abs(x - y) for x, y in zip(runs["distlab"][0]["losses"], runs["trainer"][0]["losses"]))
            result["worlds"][world] = {"summary": summary, "max_loss_gap_distlab_vs_trainer": gap, "runs": runs}
            print(json.dumps({"world": world, "summary": summary, "max_loss_gap": gap}, indent=1), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
