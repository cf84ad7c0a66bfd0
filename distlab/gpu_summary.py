"""The figures the GPU check kit ends with, read from its results (nothing recomputed):

    python -m distlab.gpu_summary build/gpu_check/results

per run: tokens/s, MFU and the peak it is measured against, peak GPU memory, the all-reduce
time in flight; each recorded OOM with its memory budget; each checkpoint validation's
verdict; the NCCL bus bandwidth (or why it was not measured). A figure that is missing is
printed as missing, with the file that should have held it.
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
    return lines


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
            out.append(f"NCCL {op} over {collectives['world_size']} GPUs: busbw {best['busbw_bytes_per_s'] / 1e9:.1f} GB/s "
                       f"at {best['size_bytes'] / 2**20:.0f} MiB (algbw {best['algbw_bytes_per_s'] / 1e9:.1f} GB/s)")
    return out


def summary(results: Path) -> list[str]:
    lines = []
    machines = sorted(p for p in results.iterdir() if p.is_dir() and (p / "hardware.json").is_file())
    if not machines:
        return [f"no machine folder with hardware.json under {results}: the kit did not get far enough"]
    for machine in machines:
        hardware = _load(machine / "hardware.json") or {}
        gpus = ", ".join(g.get("name", "?") for g in hardware.get("gpus", [])) or "no GPU in hardware.json"
        lines.append(f"== {machine.name}: {gpus}")
        runs = sorted(p.parent for p in machine.glob("*/metrics.json"))
        for run in runs:
            lines += run_lines(_load(run / "metrics.json") or {"experiment": run.name})
        validations = [v for v in (validation_line(run) for run in runs) if v]
        lines += validations or ["checkpoint validation: none finished"]
        lines += nccl_lines(_load(machine / "collectives.json"), machine / "collectives.json")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(summary(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
