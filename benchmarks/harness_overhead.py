"""Where a training job's wall time goes: the fixed costs around its timed steps.

    python benchmarks/harness_overhead.py [--experiments ID,ID,...] [--rounds 1] [--before REV]

Runs experiments of the default config as the pipeline does (distlab.jobs.launch, checkpoint on,
base-model eval file given), then their checkpoint validation (distlab.jobs.validate.validate_run),
on the default config's own prepared data and model (built here). Per job: the launch's wall
time; from rank 0's timeline (metrics.json `timeline`, distlab.runtime.timeline) the interpreter and
imports, process group, model load/wrap/verify, data and resume, the steps, gathering the
records, the held-out eval, the final save and export; the rest of the launch's wall
("launcher and teardown": the launcher process's own start, torchrun or accelerate launch,
the ranks' exit) and the validation job's wall. Prints a Markdown table and the share of
wall time spent in steps; writes results/benchmarks/harness_overhead.json. The machine's
noise during each run's steps (distlab.runtime.noise) is printed beside it. Each job's CPU time is
measured too: rank 0's per phase (the timeline's cpu_s), and the launch's and the validation's
over every process (the children's rusage: launcher, agent, all ranks).

--warm: each job with and without a warm start (distlab.launchers.warm_start: ranks and agents
forked from one interpreter that imported torch and transformers once, as a snakemake run
does), interleaved, each variant in a fresh process tree; prints per phase the median of each
and the ratio warm/fresh. CPU is the machine's (/proc/stat busy time over the job: a warm rank
is the server's child, not the launcher's), so run it on an otherwise quiet machine.

--before REV: the same jobs under the code of git revision REV (exported to a temporary folder:
its distlab, its config's specs) and under this checkout, interleaved (before then after in
even rounds, after then before in odd ones), each job in a fresh process tree, on the same
prepared data and model: prints per phase the median of each and the ratio after/before,
side by side in one run, so a cut is measured against the machine's noise of that moment.
"""
import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from distlab.records.job import Job  # noqa: E402  (after the checkout joins sys.path)

DEFAULT = ("ddp-full-w1-mb8-ga1,ddp-full-w2-mb4-ga1,accelerate-lora-w2-mb4-ga1,deepspeed-z3-full-w2-mb2-ga2,"
           "fsdp-fullshard-full-w2-mb2-ga2")


def prepare(root: Path) -> tuple[dict, dict, Path]:
    """The default config's specs; its data, model, base eval and hardware.json built here."""
    import yaml

    from distlab.data_prep import data
    from distlab.runtime import evaluation, model
    from distlab.configuration import hardware
    from distlab.configuration.config import load

    cfg, specs = load(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), gpu_count=0)
    texts = data.corpus_texts(cfg["data"])
    tok = data.train_tokenizer(texts, cfg["data"]["vocab_size"], root / "tok")
    data.build_dataset(texts, tok, cfg["defaults"]["seq_len"], cfg["data"]["eval_fraction"], cfg["data"]["seed"],
                       root / "data")
    model.build_base_model(cfg["model"]["build"], tok, root / "model")
    evaluation.evaluate_base(str(root / "model"), root / "data", root / "base_eval.json")
    (root / "hardware.json").write_text(json.dumps(hardware.describe("bench", probe=False)))
    return cfg, specs, root


def children_cpu() -> float:
    """User + system CPU seconds of every reaped child process so far (launcher, agent, ranks)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def machine_cpu() -> float:
    """CPU seconds every core spent busy so far (a warm rank is not this process's child)."""
    from distlab.runtime.noise import machine_busy_seconds

    return machine_busy_seconds() or 0.0


def run_job(spec: dict, root: Path, run_dir: Path) -> dict:
    from distlab.jobs.launch import launch
    from distlab.records.run_outputs import read_run_record
    from distlab.jobs.validate import validate_run

    job = Job(spec=spec, run_dir=str(run_dir), data_dir=str(root / "data"),
              model_source=str(root / "model"), hardware_json=str(root / "hardware.json"), env_allowlist=[],
              checkpoint_dir=str(run_dir / "checkpoint"), base_eval_json=str(root / "base_eval.json"))
    cpu, busy, start = children_cpu(), machine_cpu(), time.perf_counter()
    launch(job, log_path=str(run_dir) + ".log", timeout=1800)
    wall, job_cpu, job_machine_cpu = time.perf_counter() - start, children_cpu() - cpu, machine_cpu() - busy
    metrics = read_run_record(run_dir / "metrics.json").to_dict()
    cpu, busy, start = children_cpu(), machine_cpu(), time.perf_counter()
    validation = validate_run(run_dir, str(root / "model"), str(root / "data"), run_dir / "validation.json",
                              log_path=str(run_dir) + "-validate.log")
    validation_machine_cpu = machine_cpu() - busy
    phases = {p["phase"]: p["wall_s"] for p in metrics["timeline"]["phases"]}
    ranks_end = metrics["timeline"]["phases"][-1]["end_s"]
    return {"experiment": spec["id"], "job_wall_s": wall, "job_cpu_s": job_cpu, "phases": phases,
            "phases_cpu": {p["phase"]: p.get("cpu_s") for p in metrics["timeline"]["phases"]},
            "launcher_and_teardown_s": wall - ranks_end, "validation_wall_s": time.perf_counter() - start,
            "validation_cpu_s": children_cpu() - cpu, "job_machine_cpu_s": job_machine_cpu,
            "validation_machine_cpu_s": validation_machine_cpu, "validation": validation["status"],
            "start": metrics["timeline"].get("start"), "noise": metrics["noise"]}


def specs_of(code: Path) -> dict:
    """The default config's experiments as the distlab under `code` resolves them."""
    import yaml

    from distlab.configuration.config import load

    return load(yaml.safe_load((code / "config" / "config.yaml").read_text()), gpu_count=0)[1]


def child(args) -> None:
    """One job (training + validation) under the distlab of --code, in this fresh process."""
    row = run_job(copy.deepcopy(specs_of(Path(args.code))[args.child]), Path(args.root), Path(args.run_dir))
    Path(args.run_dir + ".row.json").write_text(json.dumps(row))


def start_warm_server(tmp: Path) -> str:
    """A warm-start server as a snakemake run's (its environment is what the ranks' will be:
    PYTHONPATH set as run_variant sets it), ready when this returns."""
    from distlab.launchers import warm_start
    from distlab.launchers.environment import warm_start_environment

    os.environ["PYTHONPATH"] = str(REPO)
    log = tmp / "warm-start.log"
    server = warm_start.start_server(warm_start_environment(), str(log))
    while "imported" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    return server


def warm_socket_env() -> str:
    from distlab.launchers import warm_start

    return warm_start.SOCKET_ENV


def run_variant(code: Path, experiment: str, root: Path, run_dir: Path, env: dict | None = None) -> dict:
    """run_job in a fresh process whose distlab (and ranks' distlab, through PYTHONPATH) is code's."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = dict(env or os.environ, PYTHONPATH=str(code))
    subprocess.run([sys.executable, __file__, "--child", experiment, "--code", str(code), "--root", str(root),
                    "--run-dir", str(run_dir)], env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(str(run_dir) + ".row.json").read_text())


def export_revision(rev: str, folder: Path) -> Path:
    """The tracked files of git revision rev, unpacked into folder (nothing of this checkout changes)."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measures(row: dict) -> dict:
    """The figures compared before/after: rank 0's phases (wall, CPU), the launch and validation."""
    out = {"job wall": row["job_wall_s"], "job CPU (machine)": row["job_machine_cpu_s"],
           "launcher + teardown wall": row["launcher_and_teardown_s"],
           "validation wall": row["validation_wall_s"], "validation CPU (machine)": row["validation_machine_cpu_s"]}
    for phase, wall in row["phases"].items():
        out[f"rank 0 {phase} wall"] = wall
        if row["phases_cpu"].get(phase) is not None:
            out[f"rank 0 {phase} CPU"] = row["phases_cpu"][phase]
    return out


def comparison(rows: list[dict]) -> tuple[str, dict]:
    """Per experiment and figure: median before, median after, after/before (Markdown, and as data)."""
    data: dict = {}
    for r in rows:
        for name, value in measures(r).items():
            data.setdefault(r["experiment"], {}).setdefault(name, {"before": [], "after": []})[r["variant"]] \
                .append(value)
    lines = ["| experiment | figure (s) | before (median) | after (median) | after / before | "
             "before runs | after runs |",
             "|---|---|---|---|---|---|---|"]
    for exp, figures in data.items():
        for name, v in figures.items():
            if not v["before"] or not v["after"]:
                continue
            b, a = statistics.median(v["before"]), statistics.median(v["after"])
            v.update(before_median=b, after_median=a, ratio=a / b if b else None)
            lines.append(f"| {exp} | {name} | {b:.2f} | {a:.2f} | {a / b:.2f}x | " if b
                         else f"| {exp} | {name} | {b:.2f} | {a:.2f} | - | ")
            lines[-1] += f"{', '.join(f'{x:.2f}' for x in v['before'])} | {', '.join(f'{x:.2f}' for x in v['after'])} |"
    return "\n".join(lines), data


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
    p.add_argument("--before", default=None, help="git revision to compare this checkout with, interleaved")
    p.add_argument("--warm", action="store_true", help="compare fresh and warm starts of this checkout, interleaved")
    p.add_argument("--out", default=str(REPO / "results" / "benchmarks" / "harness_overhead.json"))
    for internal in ("--child", "--code", "--root", "--run-dir"):  # one job of a --before run
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.path.insert(0, args.code)  # this job's distlab: the checkout's or the exported revision's
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _, specs, root = prepare(Path(tmp))
        variants = [("after", REPO)]
        if args.before:
            variants.insert(0, ("before", export_revision(args.before, Path(tmp) / "before")))
        server = start_warm_server(Path(tmp)) if args.warm else None
        if args.warm:  # before = fresh, after = warm: the same checkout
            variants = [("before", REPO), ("after", REPO)]
        for r in range(args.rounds):
            for exp in args.experiments.split(","):
                for name, code in (variants if r % 2 == 0 else variants[::-1]):
                    env = dict(os.environ)
                    if args.warm and name == "after":
                        env[warm_socket_env()] = server
                    row = (run_variant(code, exp, root, root / "runs" / name / f"r{r}" / exp, env)
                           if args.before or args.warm else
                           run_job(copy.deepcopy(specs[exp]), root, root / "runs" / f"r{r}" / exp))
                    rows.append(dict(row, variant=name, round=r))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "noise"}), flush=True)
        if server:
            from distlab.launchers import warm_start

            warm_start.stop_server(server)
    after = [r for r in rows if r["variant"] == "after"]
    total = sum(r["job_wall_s"] + r["validation_wall_s"] for r in after)
    steps = sum(r["phases"].get("steps", 0) for r in after)
    summary = {"jobs": len(after), "train_and_validation_wall_s": total, "steps_s": steps,
               "steps_share": steps / total,
               "median_fixed_cost_per_training_job_s": statistics.median(
                   r["job_wall_s"] - r["phases"].get("steps", 0) for r in after),
               "median_validation_job_s": statistics.median(r["validation_wall_s"] for r in after),
               "busy_runs": sum(bool(r["noise"].get("busy")) for r in rows), "runs": len(rows)}
    print(table(after))
    compared = None
    if args.before or args.warm:
        text, compared = comparison(rows)
        print(("\nbefore = fresh starts, after = warm starts" if args.warm else
               f"\nbefore = {args.before}, after = this checkout") + f"; {args.rounds} interleaved round(s)\n" + text)
        for variant in ("before", "after"):
            mine = [r for r in rows if r["variant"] == variant]
            summary[f"{variant}_total_machine_cpu_s"] = sum(r["job_machine_cpu_s"] + r["validation_machine_cpu_s"]
                                                            for r in mine)
            summary[f"{variant}_total_wall_s"] = sum(r["job_wall_s"] + r["validation_wall_s"] for r in mine)
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "before": "fresh starts" if args.warm else args.before,
                               "compared": compared,
                               "how": __doc__.split("\n\n")[2].strip()}, indent=1))


if __name__ == "__main__":
    main()
