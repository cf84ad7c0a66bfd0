"""Strategies as files: the schema's enum checked against the settings files, a new strategy
with a setting of its own added by its files alone, and the mechanisms every strategy shares
(one precision map, one loss-scaling rule) decided in one place each."""
import json

import pytest
from distlab.records.spec import Spec

from conftest import REPO
from distlab.configuration.config import ConfigError, load
from test_config import ddp_config


def test_the_schema_names_exactly_the_strategies_with_settings_files_and_ranks_find_them_without_it(monkeypatch):
    """config/schema.yaml's strategy enum is checked against distlab/configuration/strategies/*_settings.py
    (each strategy with settings has their block), and a rank finds its class from those files,
    not from the schema."""
    from distlab.configuration import config as config_module
    from distlab.configuration import schema as schema_module
    from distlab import strategies
    from distlab.strategies.base import Strategy
    from distlab.configuration.strategies.settings import schema_mismatch

    schema = config_module.load_schema()
    assert set(schema["$defs"]["experiment"]["properties"]["strategy"]["enum"]) == set(strategies.strategy_names())
    assert schema_mismatch(schema) is None
    for name in strategies.strategy_names():
        found = strategies.get_strategy_class(name)
        assert issubclass(found, Strategy) and found.name == name, name
    # A name in the enum without a settings file (or the reverse) stops every config.
    schema["$defs"]["experiment"]["properties"]["strategy"]["enum"].append("horovod")
    monkeypatch.setattr(config_module, "load_schema", lambda: schema)
    with pytest.raises(ConfigError, match=r"schema.yaml: its strategy enum .*'horovod'.* differs from the "
                                          r"strategies in distlab/configuration/strategies/\*_settings.py"):
        load(ddp_config({}), gpu_count=0)
    # Ranks never read the schema to find their class.
    monkeypatch.setattr(config_module, "load_schema", lambda: pytest.fail("a rank read config/schema.yaml"))
    monkeypatch.setattr(schema_module, "schema_read_only", lambda: pytest.fail("a rank read config/schema.yaml"))
    assert strategies.strategy_for(Spec({"strategy": "fsdp", "fsdp": {"via": "accelerate"}})).name == "accelerate"


MINE_MODULE = """
from distlab.strategies.base import Strategy


class MineStrategy(Strategy):
    name = "mine"


STRATEGY = MineStrategy
"""
MINE_SETTINGS = """
from distlab.configuration.strategies.settings import StrategySettings, block_schema, state


class MineSettings(StrategySettings):
    name = "mine"
    defaults = {"chunks": 2}
    schema = block_schema({"chunks": {"type": "integer", "minimum": 1}})  # its block of config/schema.yaml
    ray_train = True  # Ray Train may start it
    dcp_checkpoint = True  # its checkpoint is a DCP folder: the save estimate counts its containers
    holds_layer_run = True  # a rank holds a run of the layers: selective checkpointing is checked loosely
    advisor_rows = {"mine-c2": {"chunks": 2}}  # an advisor row it stands for
    needs_of_task = {"layer_stack": "mine cuts decoder layers"}  # what it needs of a task's model
    splits_by_family_plan = True  # it splits the model by its family's plan: a model.path family is asked

    def family_refusal(self, model_config, world_size):
        return None if getattr(model_config, "mine_plan", None) else "it declares no mine_plan"

    def parameter_layout(self, spec):
        return "dtensor"

    def offloads_parameters(self, spec):
        return spec["mine"]["chunks"] > 2

    def variant(self, spec):
        return f"c{spec['mine']['chunks']}"

    def check(self, spec, config, fail, shape):
        if spec["micro_batch"] % spec["mine"]["chunks"]:
            fail("mine.chunks",
                 f"micro_batch {spec['micro_batch']} does not split into {spec['mine']['chunks']} chunks")

    def shards_checkpoint(self, spec):
        return True

    def checkpoint_format(self, spec):
        return (spec["precision"], spec["mine"]["chunks"])

    def advisor_row(self, spec):
        return "mine"

    def model_state(self, counts, n, precision, lora, settings):
        return state({"params": 4 * counts["total"] / n * settings.get("chunks", 1), "grads": 0.0, "optimizer": 0.0})


SETTINGS = MineSettings()
"""


def test_a_new_strategy_with_a_setting_is_its_two_files(tmp_path, monkeypatch):
    """ARCHITECTURE.md's walk-through: a strategy with a setting of its own (`mine: {chunks}`)
    is its module (distlab/strategies/) and its settings file (distlab/configuration/strategies/,
    the setting's type beside its default): nothing of distlab is edited, config/schema.yaml
    included (the two packages only gain files, here through their search paths). Config
    expansion, the schema's enum and block, the id, the checks, the launcher, the validation
    scope, the advisor (its formula and its row), Ray's launcher check, the save estimate, the
    activation-checkpointing check, the parameter-layout check, the task refusal, the
    model-family check and a rank's lookup all pick it up; its runs through the summary and the
    report: test_a_new_strategy_runs_through_the_summary_and_the_report."""
    import sys

    from types import SimpleNamespace

    from distlab.configuration import families
    from distlab.configuration import strategies as declared
    from distlab.configuration.strategies.settings import registered
    from distlab import strategies
    from distlab.runtime.activations import check_checkpointing
    from distlab.tools.advisor import model_state, strategy_state
    from distlab.tools.save_estimate import save_estimate
    from distlab.strategies.base import expected_layout, offloads_parameters
    from distlab.tools.advisor_check import estimate_key
    from distlab.configuration.validation_scope import checkpoint_format, shards_checkpoint, validated_experiments

    for folder, name, text in (("strategies", "mine.py", MINE_MODULE), ("settings", "mine_settings.py", MINE_SETTINGS)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(text)
    monkeypatch.setattr(strategies, "__path__", [*strategies.__path__, str(tmp_path / "strategies")])
    monkeypatch.setattr(declared, "__path__", [*declared.__path__, str(tmp_path / "settings")])
    added = ("distlab.strategies.mine", "distlab.configuration.strategies.mine_settings")
    try:
        assert strategies.strategy_for(Spec({"strategy": "mine"})).__name__ == "MineStrategy"
        config, specs = load(ddp_config({"strategy": "mine", "world_size": 2}), gpu_count=0)
        (spec,) = specs.values()
        assert spec["mine"] == {"chunks": 2}  # its default
        assert (spec["id"], spec["launcher"]) == ("mine-c2-full-w2-mb4-ga1", "torchrun")
        assert validated_experiments(config, specs) == [spec["id"]]
        (spec,) = load(ddp_config({"strategy": "mine", "mine": {"chunks": 4}}), gpu_count=0)[1].values()
        assert spec["id"] == "mine-c4-full-w1-mb4-ga1"
        with pytest.raises(ConfigError, match=r"'stages.ddp.experiments\[0\].mine.chunks': micro_batch 4 does not "
                                              r"split into 3 chunks"):
            load(ddp_config({"strategy": "mine", "mine": {"chunks": 3}}), gpu_count=0)
        with pytest.raises(ConfigError, match=r"'stages.ddp.experiments.0.mine.chunks': 0 is less than"):
            load(ddp_config({"strategy": "mine", "mine": {"chunks": 0}}), gpu_count=0)
        assert checkpoint_format(spec) == (spec["precision"], 4) and shards_checkpoint(spec)
        assert estimate_key(spec) == "mine"
        assert strategy_state("mine", {"total": 10, "trainable": 10}, 2, "fp32", False)["params"] == 20
        assert model_state("mine-c2", {"total": 10, "trainable": 10}, 2, "fp32", False)["params"] == 40
        (ray,) = load(ddp_config({"strategy": "mine", "launcher": "ray"}), gpu_count=0)[1].values()
        assert ray["id"].endswith("-ray")
        counts = {"total": 10, "trainable": 10, "largest_unit": 5, "_shapes": [((10,), True)]}
        as_ddp, as_mine = (save_estimate(counts, 8, False, strategy=s, world_size=2) for s in ("ddp", "mine"))
        assert as_mine["native_checkpoint_bytes"] > as_ddp["native_checkpoint_bytes"]
        assert (expected_layout(spec), offloads_parameters(spec)) == ("dtensor", True)
        facts = {"layers_held": 2, "checkpointed": [1]}  # stage-local numbering: not layer 0 of the model
        assert check_checkpointing(facts, spec.replace(activation_checkpointing="selective",
                                                               activation_checkpointing_every=2)) is None
        assert check_checkpointing(facts, spec.replace(strategy="ddp", activation_checkpointing="selective",
                                                               activation_checkpointing_every=2))
        # The task it refuses, said in its settings: the task's code names no strategy.
        with pytest.raises(ConfigError, match=r"'stages.ddp.experiments\[0\].strategy': task text-to-image cannot "
                                              r"run mine: mine cuts decoder layers; a UNet's skip connections"):
            load(ddp_config({"strategy": "mine", "task": "text-to-image", "method": "lora"}), gpu_count=0)
        # What it needs of a model.path folder's family, asked by distlab.configuration.families (the folder's
        # transformers config stood in for: no transformers import here).
        folder = tmp_path / "family"
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        family = SimpleNamespace(model_type="llama")
        monkeypatch.setattr(families, "model_config", lambda path: family)
        monkeypatch.setattr(families, "causal_lm_class", lambda model_type: "LlamaForCausalLM")
        refusals = []
        families.check(spec, {"model": {"path": str(folder)}}, lambda *why: refusals.append(why),
                       registered()["mine"])
        assert refusals == [("strategy", "strategy 'mine' cannot run model type 'llama' (LlamaForCausalLM): "
                                         "it declares no mine_plan")]
        family.mine_plan = {"layers": "chunked"}
        families.check(spec, {"model": {"path": str(folder)}}, pytest.fail, registered()["mine"])
    finally:
        for name in added:
            sys.modules.pop(name, None)


TOY_MODULE = """
from distlab.strategies.ddp import DDPStrategy


class ToyStrategy(DDPStrategy):
    \"\"\"DDP under a name of its own, recording the setting it was given as it records what it built.\"\"\"
    name = "toy"

    def describe(self):
        return {**super().describe(), "toy_chunks": self.spec["toy"]["chunks"]}


STRATEGY = ToyStrategy
"""
TOY_SETTINGS = """
from distlab.configuration.strategies.settings import StrategySettings


class ToySettings(StrategySettings):
    name = "toy"
    defaults = {"chunks": 2}
    schema = {"type": "object", "additionalProperties": False,  # its block of config/schema.yaml
              "properties": {"chunks": {"description": "Chunks the toy records.", "type": "integer", "minimum": 1}}}

    def variant(self, spec):
        return f"c{spec['toy']['chunks']}"


SETTINGS = ToySettings()
"""
TOY_CARD = """
from distlab.report.cards import Card


def build(runs):
    toy = [r for r in runs if r.spec.strategy == "toy" and r.status == "ok"]
    return Card(9, "Toy", notes=[f"{r.experiment}: chunks {r.spec.toy.chunks} set, "
                                 f"{r.as_built.toy_chunks} as built" for r in toy])
"""
# Every process the test starts (torchrun's agent, the ranks) finds the toy as the test does:
# each package's search path gains its folder.
TOY_SITECUSTOMIZE = """
import distlab.configuration.strategies
import distlab.strategies

distlab.strategies.__path__.append({folder!r})
distlab.configuration.strategies.__path__.append({settings!r})
"""


@pytest.mark.slow
def test_a_new_strategy_runs_through_the_summary_and_the_report(prepared, tmp_path, monkeypatch):
    """A strategy with a setting of its own (`toy: {chunks}`), added as its module, its settings
    file and its report card (nothing of distlab edited: no schema, stage or strategy list),
    trains through the real launcher, and its run, read back from the files it wrote, is in
    the summary with its setting and in the report on its card."""
    import os
    import sys

    from conftest import resolve, run_experiment
    from distlab import strategies
    from distlab.configuration import strategies as declared
    from distlab.report import cards
    from distlab.report.build import report_rule
    from distlab.report.collect import load_checked_runs
    from distlab.report.summary_table import spreadsheet_safe, summary_frame

    for folder, files in {"strategies": {"toy.py": TOY_MODULE}, "settings": {"toy_settings.py": TOY_SETTINGS},
                          "cards": {"stage9_toy.py": TOY_CARD}}.items():
        (tmp_path / folder).mkdir()
        for name, text in files.items():
            (tmp_path / folder / name).write_text(text)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(TOY_SITECUSTOMIZE.format(
        folder=str(tmp_path / "strategies"), settings=str(tmp_path / "settings")))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "hook"), os.environ.get("PYTHONPATH"),
                                                                   str(REPO)])))
    monkeypatch.setattr(strategies, "__path__", [*strategies.__path__, str(tmp_path / "strategies")])
    monkeypatch.setattr(declared, "__path__", [*declared.__path__, str(tmp_path / "settings")])
    monkeypatch.setattr(cards, "__path__", [*cards.__path__, str(tmp_path / "cards")])
    added = ("distlab.strategies.toy", "distlab.configuration.strategies.toy_settings",
             "distlab.report.cards.stage9_toy")
    try:
        spec = resolve({"strategy": "toy", "toy": {"chunks": 3}}, steps=3, untimed_steps=1)
        assert spec["id"] == "toy-c3-full-w1-mb4-ga1" and spec["toy"] == {"chunks": 3}
        machine = json.loads((prepared / "hardware.json").read_text())["machine"]
        run_dir = tmp_path / "results" / machine / spec["id"]
        metrics = run_experiment(prepared, run_dir, spec, checkpoint=False)
        assert metrics["status"] == "ok" and metrics["as_built"]["toy_chunks"] == 3  # the toy's own rank ran

        paths = [str(run_dir / "metrics.json")]
        runs, rejected = load_checked_runs(paths)  # rule summary's reading
        assert rejected == []
        frame = summary_frame(runs)
        (row,) = frame.to_dict("records")
        assert (row["strategy"], row["experiment"]) == ("toy", spec["id"])
        assert json.loads(row["strategy_settings"]) == {"chunks": 3}
        summary = tmp_path / "results" / "summary.csv"
        spreadsheet_safe(frame).to_csv(summary, index=False)
        report = tmp_path / "results" / "report"
        left_out = report_rule(paths, summary, [], None, report / "index.html", report / "README.md")
        assert left_out == []
        readme = (report / "README.md").read_text()
        assert f"{spec['id']}: chunks 3 set, 3 as built" in readme  # its card, from its files on disk
    finally:
        for name in added:
            sys.modules.pop(name, None)


def strategy_literals(paths, names) -> list[str]:
    """`path:line: 'literal'` for every string literal in `paths` that names a strategy, or a
    field of one (`deepspeed.offload_param`)."""
    import ast

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                    node.value == name or node.value.startswith(f"{name}.") for name in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    return found


def test_no_task_or_family_code_names_a_strategy():
    """What a strategy cannot train (a task, a model family) is said in its own settings
    (needs_of_task, check_task, family_refusal), so a new strategy touches only its own files:
    distlab/tasks/, the tasks' declarations and distlab/configuration/families.py spell no
    strategy's name as a string."""
    from distlab.configuration.strategies.settings import strategy_names

    configuration = REPO / "distlab" / "configuration"
    paths = [*sorted((REPO / "distlab" / "tasks").rglob("*.py")), *sorted((configuration / "tasks").rglob("*.py")),
             configuration / "families.py"]
    assert strategy_literals(paths, strategy_names()) == []
    assert strategy_literals([configuration / "strategies" / "tp_settings.py"], ["tp"])  # the check sees them


def test_precision_names_and_the_accumulation_loss_scale_are_decided_in_one_place_each():
    """distlab/configuration/precision.py maps a precision name to its torch dtype and distlab/runtime/accumulation.py
    scales a micro-batch's loss: no other module spells either rule out again."""
    import re

    import torch

    from distlab.runtime.accumulation import for_backward
    from distlab.configuration.precision import low_precision_dtype, torch_dtype

    assert [torch_dtype(p) for p in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    assert low_precision_dtype("fp32") is None
    # A share of the step's token mean, times what a wrapper averaging 2 ranks x 3 steps divides by.
    assert for_backward(torch.tensor(0.5), 6) == 3.0
    dtype_map = re.compile(r"""["']bf16["']\s*:\s*torch\.bfloat16|torch\.bfloat16 if [^\n]*precision""")
    micro_scale = re.compile(r"/\s*\(?\s*(self\._)?n_micro\b|/\s*\(self\.n_pipe")
    package = REPO / "distlab"
    for path in package.rglob("*.py"):
        text = path.read_text()
        if path.name != "precision.py":
            assert not dtype_map.search(text), \
                f"{path}: a precision -> dtype map besides distlab/configuration/precision.py"
        if path.name != "accumulation.py":
            assert not micro_scale.search(text), \
                f"{path}: loss scaled for accumulation besides distlab/runtime/accumulation.py"
