"""The advisor's memory estimate held to what each run measured, from recorded figures only.

Rank 0 records the estimate for its own spec before its first step (metrics.json
`memory_estimate`, distlab.tools.advisor_check.estimate_record); the report compares it with the
model state and activations the run measured. Torch-free and recomputing nothing: a run recorded
without an estimate (another task, a strategy without a formula, an older distlab) is not checked."""
from __future__ import annotations

# measured / estimated model state a run may be off by and still be called right.
TOLERANCE = 0.15

# The measured per-rank state's keys (distlab.runtime.memory) that make up each estimated part.
MEASURED_PARTS = {"params": ("params", "offloaded_params"), "grads": ("grads", "grad_buckets", "offloaded_grads"),
                  "optimizer": ("optimizer", "offloaded_optimizer")}
MIB = 2**20


def recorded_row(run: dict) -> str | None:
    """The advisor row (distlab.records.advice.ROW_ORDER) the run's recorded estimate is for."""
    return (run.get("memory_estimate") or {}).get("row")


def check_memory_estimates(runs: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """Each finished run's recorded estimate next to what it measured: the total and each of
    params, grads and optimizer within `tolerance`, or 'where' names the part that is not."""
    rows = []
    for run in runs:
        est = run.get("memory_estimate")
        held = (((run.get("memory") or {}).get("model_state_bytes_per_rank")) or [None])[0]
        if run.get("status") != "ok" or not est or not held:
            continue
        # Measured state counts every tensor the rank holds, wherever it lives (offload included).
        expected = est["params"] + est["grads"] + est["optimizer"] + est["cpu_offloaded"]
        measured_parts = {part: sum(held.get(k, 0) or 0 for k in keys) for part, keys in MEASURED_PARTS.items()}
        measured = sum(measured_parts.values())
        ratio = measured / expected if expected else None
        parts = []
        for part in ("params", "grads", "optimizer"):
            guess = est[part] + est["cpu_parts"][part]
            if guess and measured_parts[part] and abs(measured_parts[part] / guess - 1) > tolerance:
                parts.append(f"{part}: estimated {guess / MIB:.1f} MiB, measured {measured_parts[part] / MIB:.1f} MiB")
        row = {"machine": run["machine"], "experiment": run["experiment"], "estimate": est["row"],
               "estimated_state_MiB": round(expected / MIB, 2), "measured_state_MiB": round(measured / MIB, 2),
               "measured/estimated": round(ratio, 3) if ratio else None,
               # right only when the total and each part are within the tolerance: a total
               # that holds while one part is far off is a formula that is wrong somewhere.
               "verdict": "right" if ratio and abs(ratio - 1) <= tolerance and not parts else "WRONG",
               "where": "; ".join(parts)}
        per_rank = run["memory"].get("per_rank") or [{}]
        row.update(activation_check(est, per_rank[0]))
        peaks = [m.get("cuda_max_allocated_bytes") for m in per_rank]
        peaks = [p for p in peaks if p]
        row["estimated_peak_MiB"] = round(est["total_bytes"] / MIB, 1)
        row["measured_cuda_peak_MiB"] = round(max(peaks) / MIB, 1) if peaks else None
        rows.append(row)
    return rows


def activation_check(est: dict, rank0: dict) -> dict:
    """Estimated vs measured activations held at the end of a micro-batch's forward (rank 0's
    ActivationProbe figure), for data-parallel strategies (every rank runs the whole model: the
    estimate records `held_activation_bytes` only for them)."""
    measured = (rank0.get("activations") or {}).get("bytes")
    estimated = est.get("held_activation_bytes")
    if not estimated or not measured:
        return {"estimated_activations_MiB": None, "measured_activations_MiB": None}
    return {"estimated_activations_MiB": round(estimated / MIB, 3),
            "measured_activations_MiB": round(measured / MIB, 3),
            "activations measured/estimated": round(measured / estimated, 3)}
