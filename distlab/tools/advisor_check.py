"""The advisor held to measurements: which advisor row a run is (estimate_key), that row's
estimate for the run's own spec, and the estimate against the run's measured per-rank state
and saved activations (check_against_runs, used by the report and the tests)."""
from __future__ import annotations

from distlab.records.spec import Spec
from distlab.runtime.activations import activation_bytes
from distlab.tools.advisor import strategy_state
from distlab.runtime.parameter_counts import workload_counts
from distlab.strategies.settings import data_parallel, registered


# measured / estimated model state a run may be off by and still be called right (the report too).
TOLERANCE = 0.15

def estimate_key(spec: dict) -> str | None:
    """Which advisor row a run's spec corresponds to (None: no formula for it); tp and pp have
    formulas of their own and no advisor row (the strategy's settings file)."""
    settings = registered().get(spec.strategy)
    return settings.advisor_row(spec) if settings else None


def spec_settings(spec: dict) -> dict:
    """What a strategy's memory formula reads: its settings block and grad_accum."""
    settings = spec.block(spec.strategy) if spec.strategy in registered() else None
    return {**(settings or {}), "grad_accum": spec.grad_accum}


def estimate_spec(shape: dict, spec: dict) -> dict | None:
    """The estimate for one run's own spec (its strategy, settings, world size, method,
    precision): per-rank model state in bytes; None for strategies without a formula."""
    lora = spec.method in ("lora", "qlora")
    counts = workload_counts(shape, spec)
    state = strategy_state(spec.strategy, counts, spec.world_size, spec.precision, lora,
                           spec_settings(spec))
    if state is None:
        return None
    act = activation_bytes(shape, spec, counts, strategy=spec.strategy)
    device_state = state["params"] + state["grads"] + state["optimizer"] + state["gathered"]
    return {**state, "model_state_bytes": device_state, "activation_bytes": act, "total_bytes": device_state + act}


MEASURED_PARTS = {"params": ("params", "offloaded_params"), "grads": ("grads", "grad_buckets", "offloaded_grads"),
                  "optimizer": ("optimizer", "offloaded_optimizer")}


def check_against_runs(advice: dict, runs: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """The advisor's estimate for each measured run's own spec next to what the run measured."""
    shape = advice["model"]["shape"]
    rows = []
    for run in runs:
        # The advice sizes the base causal LM: a run on a model.extra model, or of another task
        # (the text-to-image UNet: advise_sd), is checked by none of its rows.
        spec = Spec(run["spec"])
        if run.get("status") != "ok" or not run.get("memory") or spec.model != "default" or spec.task != "causal-lm":
            continue
        held = (run["memory"].get("model_state_bytes_per_rank") or [None])[0]
        est = estimate_spec(shape, spec) if held else None
        if est is None:
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
                parts.append(f"{part}: estimated {guess / 2**20:.1f} MiB, "
                             f"measured {measured_parts[part] / 2**20:.1f} MiB")
        row = {"machine": run["machine"], "experiment": run["experiment"], "estimate": estimate_key(spec),
               "estimated_state_MiB": round(expected / 2**20, 2), "measured_state_MiB": round(measured / 2**20, 2),
               "measured/estimated": round(ratio, 3) if ratio else None,
               # right only when the total and each part are within the tolerance: a total
               # that holds while one part is far off is a formula that is wrong somewhere.
               "verdict": "right" if ratio and abs(ratio - 1) <= tolerance and not parts else "WRONG",
               "where": "; ".join(parts)}
        peaks = [m.get("cuda_max_allocated_bytes") for m in run["memory"].get("per_rank", [])]
        peaks = [p for p in peaks if p]
        row.update(activation_check(shape, spec, run))
        row["estimated_peak_MiB"] = round(est["total_bytes"] / 2**20, 1)
        row["measured_cuda_peak_MiB"] = round(max(peaks) / 2**20, 1) if peaks else None
        rows.append(row)
    return rows


def activation_check(shape: dict, spec: dict, run: dict) -> dict:
    """Estimated vs measured activations held at the end of a micro-batch's forward (rank 0's
    ActivationProbe figure), for data-parallel strategies (every rank runs the whole model)."""
    measured = ((run["memory"].get("per_rank") or [{}])[0].get("activations") or {}).get("bytes")
    if not data_parallel(spec) or not measured:
        return {"estimated_activations_MiB": None, "measured_activations_MiB": None}
    counts = workload_counts(shape, spec)
    est = activation_bytes(shape, spec, counts, strategy=spec.strategy, part="held_bytes")
    return {"estimated_activations_MiB": round(est / 2**20, 3), "measured_activations_MiB": round(measured / 2**20, 3),
            "activations measured/estimated": round(measured / est, 3)}
