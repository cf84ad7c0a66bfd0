"""`compile: true`: regional compilation, as Accelerate and torchtitan do it: each decoder layer
compiled on its own (`layer.compile()`, inductor), not the whole model: the wrappers around
them (DDP, FSDP2) stay eager and graph breaks outside the layers cost nothing.

Compilation happens lazily in the first step's forward and backward: the run records that
step's time as compile time, apart from the steady-state step time (config time requires at
least one untimed step, distlab.configuration.training_tools).
"""
from __future__ import annotations

import statistics

HOW = ("regional compilation: layer.compile() (torch.compile, inductor) on each decoder layer before the "
       "strategy wraps the model; the wrapper and the rest of the model stay eager")


def compile_decoder_layers(model) -> dict:
    """Compile each decoder layer in place; returns what was compiled."""
    from distlab.runtime.model import decoder_layers

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile: found no decoder layers in {type(model).__name__} to compile")
    for layer in layers:
        layer.compile()
    return {"layers": len(layers), "layer_class": type(layers[0]).__name__, "how": HOW}


def compiled_layer_counts(model) -> tuple[int, int]:
    """(decoder layers of `model` that will run compiled (nn.Module.compile sets
    _compiled_call_impl), decoder layers it holds): read from the model the strategy wrapped,
    not from the spec (a pipeline stage holds only its own layers)."""
    from distlab.runtime.model import decoder_layers

    layers = decoder_layers(model)
    return sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers), len(layers)


def dynamo_counts() -> dict:
    """What torch.compile actually did in this process (dynamo's own counters): frames it
    compiled and graph breaks. Zero compiled frames means the layers ran eager."""
    from torch._dynamo.utils import counters

    return {"frames_compiled": int(counters["frames"]["ok"]), "frames_total": int(counters["frames"]["total"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "unique_graphs": int(counters["stats"]["unique_graphs"])}


def compile_record(step_rows: list[dict], first_step: int, untimed_steps: int, dynamo: dict) -> dict:
    """metrics.json timing.compile: the launch's first step (which compiled the layers) against
    the steady-state median, which leaves the untimed steps out; `dynamo`: dynamo_counts() of
    rank 0. A run in which torch compiled nothing fails (FidelityError): its label would lie."""
    if not dynamo["frames_compiled"]:
        from distlab.errors import FidelityError

        raise FidelityError(f"compile: true, but torch compiled no frame in this run ({dynamo})")
    first = step_rows[first_step]["step_time_s"]
    steady = [row["step_time_s"] for row in step_rows[max(untimed_steps, first_step + 1):]]
    median = statistics.median(steady)
    return {"first_step_s": first, "steady_step_s_median": median, "compile_s": max(first - median, 0.0),
            "dynamo": dynamo,
            "how": f"compile_s = time of step {first_step} (the launch's first, where torch compiles the layers' "
                   "forward and backward) minus the steady-state median step time; that step is untimed, so the "
                   "steady-state figures exclude it. Evaluation forwards compile once more, outside every step"}
