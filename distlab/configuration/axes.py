"""Every axis a config or a run may name, each declared once, and the schemas' enums filled
from those declarations.

The declarations: the strategies are the files distlab/configuration/strategies/<name>_settings.py,
the tasks the modules of distlab/configuration/tasks/ holding a `DECLARATION` (units: each
task's `unit`), the launchers LAUNCHERS below (their code: distlab.launchers.REGISTRY), the
precisions distlab.configuration.precision.PRECISIONS, and the stages, methods, devices and
samplers the tuples below; a strategy's own choices (`deepspeed.offload_param`) its settings'
`schema`. config/schema.yaml and distlab/report/results_schema.yaml hold no list of them:
`enum_from: <axis>` (and
`enum_extra: [...]`, the config's own words such as `auto`) is replaced by
`enum: [...extra, ...names]` when a schema is loaded (`fill_enums`), so a strategy or task
added by its files is accepted by the config and kept by the summary and the report.

Light (no torch at import): the Snakefile loads it at parse time."""
from __future__ import annotations

# Roadmap order; the report shows stages in this order. `links` and `unequal` are opt-in:
# built only by their own targets (`snakemake links`, `snakemake unequal`), never by the default run.
STAGE_ORDER = ["ddp", "accelerate", "deepspeed", "fsdp", "ray", "parallel", "links", "unequal"]
OPT_IN_STAGES = ("links", "unequal")
# Full fine-tuning, LoRA adapters (peft), QLoRA (LoRA on a 4-bit base): config/schema.yaml says more.
METHODS = ("full", "lora", "qlora")
# The libraries a method's ranks import beyond the warm-start server's preloads (a warm start's
# flavour, distlab.launchers.warm_start.rank_imports): PEFT's adapters, bitsandbytes' 4-bit layers.
METHOD_LIBRARIES = {"lora": ("peft",), "qlora": ("peft", "bitsandbytes")}
# What starts a run's ranks: each name's code is distlab.launchers.REGISTRY's entry, imported only
# when a run asks for it (tests/test_axes.py checks the two name the same launchers).
LAUNCHERS = ("torchrun", "accelerate", "ray")
# The libraries a launcher's ranks import beyond the warm-start server's preloads (as a strategy's
# settings declare its own: distlab.launchers.warm_start.rank_imports).
RANK_LIBRARIES = {"accelerate": ("accelerate",)}
# Where a run computes (a config's `auto` resolves to one of them at expansion).
DEVICES = ("cpu", "cuda")
# distributed: disjoint shards per rank; none: every rank reads all of it.
SAMPLERS = ("distributed", "none")


def names() -> dict[str, list]:
    """{axis: the names it may take}, read from each axis's one declaration."""
    from distlab.configuration.precision import PRECISIONS
    from distlab.configuration.strategies.settings import registered, strategy_names
    from distlab.configuration.tasks.declaration import declaration_named, task_names

    # A strategy's own choices (`deepspeed.offload_param`), as its settings' schema declares them.
    settings = {f"{name}.{key}": list(field["enum"]) for name, s in registered().items() if s.schema
                for key, field in s.schema["properties"].items() if "enum" in field}
    return {"stages": list(STAGE_ORDER), "strategies": strategy_names(), "launchers": sorted(LAUNCHERS),
            "tasks": task_names(), "units": sorted({declaration_named(name).unit for name in task_names()}),
            "precisions": list(PRECISIONS), "methods": list(METHODS), "devices": list(DEVICES),
            "samplers": list(SAMPLERS), **settings}


def frozen_names() -> tuple:
    """names() as a hashable key: a schema parsed and filled once per set of names (a strategy
    or task registered since is in the next one's enums)."""
    return tuple((axis, tuple(values)) for axis, values in names().items())


def fill_enums(node, axes: dict | None = None):
    """`node` (a parsed schema) with every `enum_from: <axis>` replaced by the axis's names, and
    every `fields_per_unit` by one set of fields per unit, in place; returned for chaining. An
    unknown axis is a KeyError naming it.

    `fields_per_unit: {properties: {_per_s: S, ...}, required: [_per_s, ...]}` on an object
    schema gives it the property `<unit>s_per_s` (schema S) for every unit, and an `anyOf`: the
    required fields of one unit (a run counts in its task's unit: tokens_per_s, images_per_s)."""
    axes = names() if axes is None else axes
    if isinstance(node, dict):
        if "enum_from" in node:
            node["enum"] = list(node.pop("enum_extra", [])) + list(axes[node.pop("enum_from")])
        if "fields_per_unit" in node:
            fields = node.pop("fields_per_unit")
            for unit in axes["units"]:
                for suffix, schema in fields["properties"].items():
                    node.setdefault("properties", {})[f"{unit}s{suffix}"] = schema
            node["anyOf"] = [{"required": [f"{unit}s{suffix}" for suffix in fields["required"]]}
                             for unit in axes["units"]]
        for value in node.values():
            fill_enums(value, axes)
    elif isinstance(node, list):
        for value in node:
            fill_enums(value, axes)
    return node
