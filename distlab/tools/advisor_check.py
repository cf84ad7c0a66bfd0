"""The advisor held to measurements: which advisor row a run is (estimate_key), that row's
estimate for the run's own spec (estimate_spec; estimate_record, which rank 0 records before its
first step), and the estimate against the run's measured per-rank state and saved activations
(check_against_runs: computed now, for the tests and benchmarks; the report compares the
recorded one, distlab.records.memory_check)."""
from __future__ import annotations

from distlab.records.memory_check import TOLERANCE, check_memory_estimates
from distlab.records.spec import Spec
from distlab.runtime.activations import activation_bytes
from distlab.tools.advisor import strategy_state
from distlab.runtime.parameter_counts import workload_counts
from distlab.configuration.strategies.settings import data_parallel, registered



def estimate_key(spec: Spec) -> str | None:
    """Which advisor row a run's spec corresponds to (None: no formula for it); tp and pp have
    formulas of their own and no advisor row (the strategy's settings file)."""
    settings = registered().get(spec.strategy)
    return settings.advisor_row(spec) if settings else None


def spec_settings(spec: Spec) -> dict:
    """What a strategy's memory formula reads: its settings block and grad_accum."""
    settings = spec.block(spec.strategy) if spec.strategy in registered() else None
    return {**(settings or {}), "grad_accum": spec.grad_accum}


def estimate_spec(shape: dict, spec: Spec) -> dict | None:
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


def estimate_record(shape: dict, spec) -> dict | None:
    """What rank 0 records before its first step (metrics.json `memory_estimate`): the advisor
    row its spec is, the per-rank model state and activations estimate_spec gives, and for
    data-parallel strategies the activations held at the end of one micro-batch's forward (what
    the rank's ActivationProbe measures). None: no formula for the strategy."""
    est = estimate_spec(shape, spec)
    if est is None:
        return None
    held = None
    if data_parallel(spec):
        held = activation_bytes(shape, spec, workload_counts(shape, spec), strategy=spec.strategy, part="held_bytes")
    return {"row": estimate_key(spec), **est, "held_activation_bytes": held}


def check_against_runs(advice: dict, runs: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """The advisor's estimate for each measured causal-LM run of the base model, computed now for
    the run's own spec, next to what the run measured (distlab.records.memory_check, which the
    report reads with the estimate each run recorded)."""
    shape = advice["model"]["shape"]
    estimated = []
    for run in runs:
        spec = Spec(run["spec"])
        if run.get("status") != "ok" or not run.get("memory") or spec.model != "default" or spec.task != "causal-lm":
            continue
        estimated.append({**run, "memory_estimate": estimate_record(shape, spec)})
    return check_memory_estimates(estimated, tolerance)
