"""Every axis declared once: the strategies, tasks, launchers, stages, units, precisions,
methods, devices and samplers a config or a run may name come from the code's declarations,
and neither schema file lists any of them by hand."""
from __future__ import annotations

import yaml

from conftest import REPO

SCHEMA_FILES = [REPO / "config" / "schema.yaml", REPO / "distlab" / "report" / "results_schema.yaml"]
# The config's own words beside an axis's names (`launcher: auto`, `device: auto`).
CONFIG_WORDS = {"auto"}


def declared_axes() -> dict[str, set]:
    """Each axis as its declaration gives it (read from the registries themselves)."""
    from distlab.configuration.axes import LAUNCHERS
    from distlab.configuration.config import STAGE_ORDER
    from distlab.launchers import REGISTRY
    from distlab.configuration.precision import PRECISIONS
    from distlab.configuration.strategies.settings import strategy_names
    from distlab.tasks import task_named, task_names

    assert set(REGISTRY) == set(LAUNCHERS), "every declared launcher has its code, and no other"
    return {"stages": set(STAGE_ORDER), "strategies": set(strategy_names()), "launchers": set(LAUNCHERS),
            "tasks": set(task_names()), "units": {task_named(name).unit for name in task_names()},
            "precisions": set(PRECISIONS)}


def enums(node, where=""):
    """(where, values) of every `enum` in a parsed schema."""
    if isinstance(node, dict):
        if isinstance(node.get("enum"), list):
            yield where, node["enum"]
        for key, value in node.items():
            yield from enums(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from enums(value, f"{where}[{index}]")


def test_neither_schema_file_lists_an_axis_by_hand():
    """A hand-written enum whose values are all names of one axis is a copy of it: it misses
    the next strategy, task or stage added by its files (a run of it then refused)."""
    axes = declared_axes()
    copies = [f"{path.relative_to(REPO)}: {where} {values} copies the {axis}"
              for path in SCHEMA_FILES for where, values in enums(yaml.safe_load(path.read_text()))
              for axis, names in axes.items()
              if set(values) - CONFIG_WORDS and set(values) <= names | CONFIG_WORDS]
    assert copies == []


def test_both_schemas_name_exactly_each_axis_of_the_code_once_loaded():
    from distlab.configuration.schema import load_schema
    from distlab.report.collect import _schemas

    axes = declared_axes()
    config = load_schema()
    experiment = config["$defs"]["experiment"]["properties"]
    results = _schemas()
    spec = results["$defs"]["spec"]["properties"]
    assert set(experiment["strategy"]["enum"]) == set(spec["strategy"]["enum"]) == axes["strategies"]
    assert set(experiment["task"]["enum"]) == set(spec["task"]["enum"]) == axes["tasks"]
    assert set(experiment["launcher"]["enum"]) == axes["launchers"] | {"auto"}
    assert set(spec["launcher"]["enum"]) == axes["launchers"]
    assert set(experiment["precision"]["enum"]) == set(spec["precision"]["enum"]) == axes["precisions"]
    assert set(experiment["device"]["enum"]) - {"auto"} == set(spec["device"]["enum"])
    assert experiment["method"]["enum"] == spec["method"]["enum"]
    assert experiment["sampler"]["enum"] == spec["sampler"]["enum"]
    assert set(config["properties"]["stages"]["propertyNames"]["enum"]) == axes["stages"]
    assert set(results["metrics"]["properties"]["stage"]["enum"]) == axes["stages"]
    assert {"links", "unequal"} <= axes["stages"]  # the opt-in pages' runs are runs of a stage
    throughput = results["$defs"]["ok_run"]["properties"]["throughput"]
    assert set(throughput["properties"]["unit"]["enum"]) == axes["units"]
    # Each strategy's block is typed once, in its settings file, with every key its defaults hold.
    from distlab.configuration.strategies.settings import registered

    for name, settings in registered().items():
        if settings.defaults is not None:
            assert experiment[name] == settings.schema, name
            assert set(settings.defaults) <= set(settings.schema["properties"]), name


def test_a_strategy_settings_choices_are_read_from_its_settings_in_the_results_schema():
    from distlab.report.collect import _schemas
    from distlab.configuration.strategies.settings import registered

    spec = _schemas()["$defs"]["spec"]["properties"]
    for name, key in (("deepspeed", "offload_optimizer"), ("deepspeed", "offload_param"), ("fsdp", "via")):
        assert spec[name]["properties"][key]["enum"] == registered()[name].schema["properties"][key]["enum"]
