"""The figures the GPU check kit ends with, read from its results (nothing recomputed):

    python -m distlab.tools.gpu_summary build/gpu_check/results [--configfile config/gpu_check.yaml ...] [--gpus N]

per run: tokens/s, MFU and the peak it is measured against, peak GPU memory, the all-reduce
time in flight; each recorded OOM with its memory budget; each checkpoint validation's
verdict; the NCCL bus bandwidth (or why it was not measured). A figure that is missing is
printed as missing, with the file that should have held it.

With the config files the kit ran (--configfile, merged as Snakemake merges them), every
planned run and validation is listed with its status, also those that crashed before writing
anything, and the exit status is 1 when any of them failed (named on the last line).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _peak_memory(metrics: dict) -> str:
    ranks = metrics.get("memory", {}).get("per_rank") or []
    allocated = [r.get("cuda_max_allocated_bytes") for r in ranks if r.get("cuda_max_allocated_bytes") is not None]
    reserved = [r.get("cuda_max_reserved_bytes") for r in ranks if r.get("cuda_max_reserved_bytes") is not None]
    if not allocated:
        return "peak GPU memory: not recorded"
    return f"peak GPU memory {max(allocated) / GIB:.2f} GiB allocated, {max(reserved or [0]) / GIB:.2f} GiB reserved"


def run_lines(metrics: dict) -> list[str]:
    name = metrics.get("experiment", "?")
    if metrics.get("status") == "oom":
        error = (metrics.get("oom") or [{}])[0].get("error", "")
        return [f"{name}: recorded OOM under a {metrics.get('memory_budget_gib')} GiB budget: {error[:160]}"]
    tps = metrics.get("throughput", {}).get("tokens_per_s")
    flops = metrics.get("flops", {})
    mfu, peak = flops.get("mfu"), flops.get("peak_flops_per_rank")
    comm = metrics.get("timing", {}).get("comm_inflight_s_per_step") or {}
    line = (f"{name}: {tps:,.0f} tokens/s" if tps is not None else f"{name}: tokens/s not recorded")
    line += (f", MFU {mfu:.1%} of {peak / 1e12:.1f} TFLOP/s ({flops.get('peak_how')})" if mfu is not None and peak
             else f", MFU not measured ({flops.get('peak_how', 'no peak')})")
    lines = [line, f"    {_peak_memory(metrics)}"]
    if comm.get("median") is not None:
        lines.append(f"    all-reduce in flight {comm['median'] * 1e3:.2f} ms/step (median; "
                     f"{metrics.get('as_built', {}).get('comm_timing', 'timing method not recorded')})")
    lines.append(f"    {prediction_line(metrics)}")
    return lines


def prediction_line(metrics: dict) -> str:
    """The step time the job predicted before the run against the measured median."""
    from distlab.records.predictions import score

    prediction = metrics.get("prediction") or {}
    if prediction.get("status") != "predicted":
        return f"step time not predicted: {prediction.get('why', 'no prediction recorded')}"
    measured = (metrics.get("timing", {}).get("step_time_s") or {}).get("median")
    scored = score(prediction, measured, (metrics.get("noise") or {}).get("busy"))
    terms = ", ".join(f"{name} {term['seconds'] * 1e3:.1f}" for name, term in prediction["terms"].items())
    if measured is None:
        return f"step time predicted {prediction['step_time_s'] * 1e3:.1f} ms ({terms}); not measured"
    return (f"step time predicted {prediction['step_time_s'] * 1e3:.1f} ms ({terms} ms), measured "
            f"{measured * 1e3:.1f} ms: {scored['error']:+.0%}, {scored['verdict']}")


def validation_line(run_dir: Path) -> str | None:
    path = run_dir / "validation.json"
    if not path.is_file():
        return None
    result = _load(path) or {}
    checks = ", ".join(f"{n} {c.get('status')}" for n, c in sorted(result.get("checks", {}).items())
                       if isinstance(c, dict) and "status" in c)
    reason = f" ({result['reason']})" if result.get("reason") else ""
    return f"{result.get('experiment', run_dir.name)}: checkpoint validation {result.get('status')}{reason}: {checks}"


def nccl_lines(collectives: dict | None, path: Path) -> list[str]:
    if collectives is None:
        return [f"NCCL bandwidth: no {path} (the collectives rule did not finish)"]
    nccl = collectives.get("nccl", {})
    if nccl.get("status") == "skipped":
        return [f"NCCL bandwidth: not measured: {nccl.get('reason')}"]
    rows = [r for r in collectives.get("results", []) if r.get("backend") == "nccl" and r.get("status") == "ok"]
    if not rows:
        return ["NCCL bandwidth: no NCCL row measured" + (f" ({nccl['status']})" if nccl.get("status") else "")]
    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        mine = [r for r in rows if r["op"] == op]
        if mine:
            best = max(mine, key=lambda r: r["busbw_bytes_per_s"])
            out.append(f"NCCL {op} over {collectives['world_size']} GPUs: "
                       f"busbw {best['busbw_bytes_per_s'] / 1e9:.1f} GB/s "
                       f"at {best['size_bytes'] / 2**20:.0f} MiB (algbw {best['algbw_bytes_per_s'] / 1e9:.1f} GB/s)")
    return out


def planned(configfiles: list[str], gpus: int) -> dict:
    """{"experiments", "validated", "budgeted": ids} the kit's config files plan (merged in order, as
    Snakemake merges several --configfile)."""
    import yaml

    from distlab.configuration.config import _deep_merge, load
    from distlab.configuration.validation_scope import validated_experiments

    merged: dict = {}
    for path in configfiles:
        merged = _deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    config, specs = load(merged, gpu_count=gpus)
    return {"experiments": list(specs), "validated": validated_experiments(config, specs),
            "budgeted": [i for i, spec in specs.items() if spec.memory_budget_gib is not None]}


def run_status(run: Path, budgeted: bool) -> tuple[str | None, list[str]]:
    """(why this planned run failed or None, its lines)."""
    metrics = _load(run / "metrics.json")
    if metrics is None:
        why = f"no metrics.json: the run crashed or never started (see {run / 'train.log'})"
        return why, [f"{run.name}: FAILED: {why}"]
    lines = run_lines(metrics)
    status = metrics.get("status")
    saved = metrics.get("checkpoint") or {}
    if status == "oom" and budgeted:
        return None, lines  # the lesson of a memory_budget_gib run
    if status != "ok":
        return f"status {status}", lines + [f"    FAILED: the run ended with status {status!r}"]
    if isinstance(saved, dict) and saved.get("status") == "failed":
        why = f"trained, but its checkpoint save failed: {str(saved.get('error', ''))[:160]}"
        return why, lines + [f"    FAILED: {why}"]
    if budgeted:
        budget = (metrics.get("spec") or {}).get("memory_budget_gib")
        lines.append(f"    note: it did not run out of memory under its {budget} GiB budget")
    return None, lines


def summarize(results: Path, plan: dict | None = None) -> tuple[list[str], list[str]]:
    """(lines, names of the planned runs and validations that failed)."""
    lines, failed = [], []
    machines = sorted(p for p in results.iterdir() if p.is_dir() and (p / "hardware.json").is_file()) \
        if results.is_dir() else []
    if not machines:
        lines = [f"no machine folder with hardware.json under {results}: the kit did not get far enough"]
        failed = list((plan or {}).get("experiments", []))
        return lines + ([f"FAILED ({len(failed)}, none ran): {', '.join(failed)}"] if failed else []), failed
    for machine in machines:
        hardware = _load(machine / "hardware.json") or {}
        gpus = ", ".join(g.get("name", "?") for g in hardware.get("gpus", [])) or "no GPU in hardware.json"
        lines.append(f"== {machine.name}: {gpus}")
        if plan is None:
            runs = sorted(p.parent for p in machine.glob("*/metrics.json"))
            for run in runs:
                lines += run_lines(_load(run / "metrics.json") or {"experiment": run.name})
            validations = [v for v in (validation_line(run) for run in runs) if v]
            lines += validations or ["checkpoint validation: none finished"]
        else:
            for name in plan["experiments"]:
                why, run_out = run_status(machine / name, name in plan.get("budgeted", ()))
                lines += run_out
                failed += [name] if why else []
            for name in plan["validated"]:
                line = validation_line(machine / name)
                verdict = (_load(machine / name / "validation.json") or {}).get("status")
                if line is None or verdict != "passed":
                    failed.append(f"{name} (validation)")
                lines.append(line or f"{name}: checkpoint validation FAILED: no validation.json (it did not finish)")
        lines += nccl_lines(_load(machine / "collectives.json"), machine / "collectives.json")
    if failed:
        lines.append(f"FAILED ({len(failed)}): {', '.join(failed)}")
    return lines, failed


def summary(results: Path, plan: dict | None = None) -> list[str]:
    return summarize(results, plan)[0]


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--configfile", nargs="+", default=[], help="the config files the kit ran, in order")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the kit planned for")
    args = parser.parse_args(argv)
    plan = None
    if args.configfile:
        plan = planned(args.configfile, args.gpus)
    lines, failed = summarize(args.results, plan)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
