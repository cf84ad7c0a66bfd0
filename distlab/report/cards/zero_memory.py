"""ZeRO per-rank model state for the stage-3 card: the paper's formula, the rows measured
runs give against it and DeepSpeed's estimator, and their figure."""
from __future__ import annotations

from distlab.report.plots import figure, to_png_b64
from distlab.report.report_run import ReportRun

MIB = 2**20
GAP_LIMIT = 0.10  # measured vs formula beyond this is explained in a note

# Bytes per parameter of (weights, grads, optimizer state). Mixed precision is the ZeRO
# paper's (Rajbhandari et al. 2020): 2 + 2 + K=12 (fp32 master 4, Adam m 4, v 4). In fp32
# the weights and grads are 4 bytes; ZeRO 1-3 still keep a separate fp32 master partition
# (K=12), while stage 0 steps the weights themselves (K=8: Adam m and v only).
BYTES_PER_PARAM = {"fp32": (4, 4, 12), "mixed": (2, 2, 12)}


def zero_formula_bytes(psi: int, world: int, stage: int, precision: str) -> float:
    """Per-rank model-state bytes: optimizer state sharded from stage 1, grads from 2, weights at 3."""
    return sum(zero_formula_parts(psi, world, stage, precision).values())



def zero_formula_parts(psi: int, world: int, stage: int, precision: str) -> dict:
    weights, grads, optim = BYTES_PER_PARAM["fp32" if precision == "fp32" else "mixed"]
    if stage == 0 and precision == "fp32":
        optim = 8
    return {"params": weights * psi / (world if stage >= 3 else 1),
            "grads": grads * psi / (world if stage >= 2 else 1),
            "optimizer": optim * psi / (world if stage >= 1 else 1)}


def formula_text(stage: int, precision: str) -> str:
    parts = zero_formula_parts(1, 1, stage, precision)  # bytes per parameter, N left symbolic
    terms = [f"{int(v)}*Psi{'/N' if stage >= lim else ''}"
             for v, lim in ((parts["params"], 3), (parts["grads"], 2), (parts["optimizer"], 1))]
    return " + ".join(terms)


def state_bytes_with_offload(state: dict) -> dict:
    """Model state one rank held, where offloaded state counts with its category."""
    return {k: state.get(k, 0) + state.get(f"offloaded_{k}", 0) for k in ("params", "grads", "optimizer")}


def largest_rank_state(run: ReportRun) -> dict:
    states = [s for s in run.memory.model_state_bytes_per_rank if s]
    return max(states, key=lambda s: sum(state_bytes_with_offload(s).values()))


def gap_note(run, measured: dict, expected: dict) -> str:
    """Where a gap over 10% sits: each category measured vs the formula."""
    parts = [f"{k} {measured[k] / MIB:.2f} vs {expected[k] / MIB:.2f} MiB" for k in expected
             if abs(measured[k] - expected[k]) > GAP_LIMIT * max(expected[k], 1)]
    why = []
    if run.spec.deepspeed.zero_stage == 1 and run.spec.grad_accum == 1:
        why.append("with grad_accum 1 DeepSpeed's ZeRO-1 reduces and frees the whole gradients inside the "
                   "boundary backward, so no snapshot after a backward holds them")
    if run.spec.deepspeed.offload_optimizer != "none" and measured["grads"] > expected["grads"]:
        why.append("ZeRO-Offload keeps a second fp32 copy of the gradient partition in host memory for the "
                   "CPU optimizer step")
    return "; ".join(parts + why)


def memory_rows(ds_runs: list[ReportRun]) -> list[dict]:
    rows = []
    # The formulas assume every parameter trains; LoRA runs hold frozen weights outside them.
    ds_runs = [r for r in ds_runs if r.spec.method == "full"]
    for run in sorted(ds_runs, key=lambda r: (r.machine, r.spec.deepspeed.zero_stage, r.experiment)):
        spec, as_built = run.spec, run.as_built
        stage, world = as_built.deepspeed.zero_stage, as_built.world_size
        psi = run.section("parameters").trainable
        state = largest_rank_state(run)
        measured = state_bytes_with_offload(state)
        total = sum(measured.values())
        expected = zero_formula_parts(psi, world, stage, spec.precision)
        formula = sum(expected.values())
        estimator = as_built.deepspeed.get("estimator") or {}
        off = sum(state.get(f"offloaded_{k}", 0) for k in ("params", "grads", "optimizer"))
        device_held = total - off
        est = estimator.get("device_bytes")
        if off and spec.device == "cpu":
            est = None  # offloaded and "device" state share host memory: no device figure to compare
            estimator = dict(estimator, device_bytes=None,
                             why="n/a: on a CPU run offloaded and device state share host memory")
        gap = total / formula - 1
        rows.append({
            "machine": run.machine, "experiment": run.experiment, "ZeRO stage": stage, "ranks": world,
            "offload (opt/param)":
                f"{as_built.deepspeed.offload_optimizer}/{as_built.deepspeed.offload_param}",
            "precision": spec.precision, "params (Psi)": psi,
            "measured state (MiB/rank)": round(total / MIB, 3),
            "of it offloaded (MiB)": round(off / MIB, 3),
            "formula": formula_text(stage, spec.precision),
            "formula (MiB)": round(formula / MIB, 3),
            "gap vs formula": f"{gap:+.1%}",
            "DeepSpeed estimator, device (MiB)": round(est / MIB, 3) if est is not None else "n/a",
            "measured on device vs estimator": f"{device_held / est - 1:+.1%}" if est else
            (estimator.get("why") or "n/a"),
            "other ZeRO buffers (MiB)": round(state.get("other", 0) / MIB, 3),
            "_gap": gap, "_run": run, "_measured": measured, "_expected": expected, "_estimator": estimator,
        })
    return rows


def memory_figure(rows: list[dict]) -> str:
    fig, ax = figure(6.5, 3.6)
    labels = [f"z{r['ZeRO stage']} w{r['ranks']}{' off' if r['of it offloaded (MiB)'] else ''}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.27 for x in xs], [r["measured state (MiB/rank)"] for r in rows], 0.27, label="measured")
    ax.bar(list(xs), [r["formula (MiB)"] for r in rows], 0.27, label="ZeRO formula")
    est = [r["DeepSpeed estimator, device (MiB)"] for r in rows]
    ax.bar([x + 0.27 for x in xs], [e if isinstance(e, float) else 0 for e in est], 0.27,
           label="DeepSpeed estimator (device)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title("ZeRO per-rank model state")
    ax.legend(fontsize=7)
    return to_png_b64(fig)
