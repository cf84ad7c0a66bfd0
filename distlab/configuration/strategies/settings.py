"""What the config layer, the validation scope and the advisor know of a strategy, without
importing torch: its settings' defaults, their checks, the experiment-id part they make, what
of them changes the checkpoint, and its memory formula.

Each strategy `<name>` declares these in distlab/configuration/strategies/<name>_settings.py, as
`SETTINGS = <StrategySettings subclass instance>`, beside its rank-time module
distlab/strategies/<name>.py. The registry is those files, found by their names (a directory
listing: no schema read, no torch): they are the list of strategies. The Snakefile's config
expansion (distlab.configuration.config), distlab.configuration.validation_scope, the advisor
and every rank (distlab.strategies.strategy_for) read strategies through it. config/schema.yaml's
strategy enum is filled from the same files and each one's block from its `schema`
(distlab.configuration.schema); `schema_mismatch`, checked when a config is validated, refuses a
schema that differs from them.
"""
from __future__ import annotations

import copy
import functools
import math
import sys

from distlab.records.spec import SpecFields
from distlab.configuration.precision import is_mixed
from distlab.registry import discover

SUFFIX = "_settings"


class StrategySettings:
    """A strategy with no settings of its own: subclasses override what theirs change."""

    name: str = ""
    #: The spec's `<name>:` block as every experiment inherits it (None: the strategy has none).
    defaults: dict | None = None
    #: The JSON Schema of that block (`block_schema`), put into config/schema.yaml's experiment
    #: as its `<name>:` property when the schema loads (distlab.configuration.schema): a strategy's
    #: settings are typed here, beside their defaults, not in the schema file.
    schema: dict | None = None
    #: What `launcher: auto` starts the strategy's ranks with.
    launcher: str = "torchrun"
    #: The libraries its ranks import beyond the warm-start server's preloads: a warm start forks
    #: them from a server that imported these too (distlab.launchers.warm_start.rank_imports).
    rank_libraries: tuple[str, ...] = ()
    #: Whether each rank reads its own samples (False: the ranks split the model and read the same ones).
    data_parallel: bool = True
    #: Whether Ray Train can start it (`launcher: ray`): Ray sets up its process group.
    ray_train: bool = False
    #: Whether its checkpoint is a torch.distributed.checkpoint folder (distlab.checkpoint_formats.dcp),
    #: whose per-tensor containers the save estimate counts.
    dcp_checkpoint: bool = False
    #: Whether a rank holds a run of the decoder layers numbered in the whole model (a pipeline
    #: stage): there selective activation checkpointing cannot be checked layer by layer.
    holds_layer_run: bool = False
    #: The advisor rows (distlab.records.advice.ROW_ORDER) this strategy stands for: {row: its settings block}.
    advisor_rows: dict[str, dict] = {}
    #: {task trait: why this strategy needs it} (the traits: TaskDeclaration.lacks, distlab.configuration.tasks): an
    #: experiment whose task's model lacks one is refused naming its `strategy` field
    #: (check_task). Traits, not names: no task lists strategies, no strategy lists tasks.
    needs_of_task: dict[str, str] = {}
    #: Whether it splits the model by the model family's own plans (the transformers config of a
    #: `model.path` folder, read at config time by distlab.configuration.families; family_refusal says what it
    #: needs of them). False: it calls the model's forward whole and runs every causal-LM family,
    #: so the config never imports transformers for it at parse time.
    splits_by_family_plan: bool = False

    def runs_as(self, spec: SpecFields) -> str:
        """The strategy module that runs the spec (FSDP through Accelerate is Accelerate's)."""
        return self.name

    def variant(self, spec: SpecFields) -> str:
        """The strategy-specific part of the experiment id (e.g. `z3-offopt`); "" for none."""
        return ""

    def check(self, spec: SpecFields, config: dict, fail, shape: dict) -> None:
        """fail(field, why) for settings this strategy refuses; `shape` is the model's config
        (distlab.configuration.config.model_shape)."""

    def check_task(self, task, spec: SpecFields, fail) -> None:
        """fail(field, why) for what of `task` (its declaration) this strategy cannot train:
        the task whole (a trait of needs_of_task its model lacks) or, in subclasses, settings of
        its own the task's model cannot take. Checked before the task's own refusals
        (distlab.configuration.config)."""
        for trait, why in self.needs_of_task.items():
            if trait in task.lacks:
                fail("strategy", f"task {task.name} cannot run {self.name}: {why}; {task.lacks[trait]}")

    def family_refusal(self, model_config, world_size: int) -> str | None:
        """Why this strategy cannot split a model of the family `model_config` (its transformers
        config) over world_size ranks, or None; asked only when splits_by_family_plan."""
        return None

    def accelerate_plugin(self, spec: SpecFields) -> str | None:
        """The distributed_type Accelerate runs this spec with when it is not plain data
        parallel ("FSDP": FSDP through Accelerate); None: DDP or one process."""
        return None

    def accelerate_config(self, spec: SpecFields) -> dict:
        """What the Accelerate config file adds for accelerate_plugin (FSDP: its fsdp_config block)."""
        return {}

    def parameter_layout(self, spec: SpecFields) -> str | None:
        """The parameter form the strategy leaves behind ("dtensor", "deepspeed_partition");
        None: plain tensors."""
        return None

    def offloads_parameters(self, spec: SpecFields) -> bool:
        """Whether a CUDA run's parameters may legitimately sit in host memory."""
        return False

    def shards_checkpoint(self, spec: SpecFields) -> bool:
        """Whether the run's checkpoint holds per-rank shards (validation scope 'sharded')."""
        return False

    def checkpoint_format(self, spec: SpecFields) -> tuple:
        """What of the spec changes the checkpoint a run writes, beyond strategy x method x
        launcher (world size and batch shape do not)."""
        return (spec.precision,)

    def advisor_row(self, spec: SpecFields) -> str | None:
        """The advisor row (distlab.records.advice.ROW_ORDER, or a formula of its own) a run's spec
        corresponds to; None: the advisor has no formula for it and checks none of its runs."""
        return None

    def model_state(self, counts: dict, n: int, precision: str, lora: bool, settings: dict) -> dict | None:
        """Bytes one of n ranks holds (`state(...)`), as this strategy allocates them
        (distlab.tools.advisor's docstring); settings: the spec's block and grad_accum. None: no formula."""
        return None

    def module_precision(self, workload: dict) -> bool:
        """True when the strategy keeps the module itself in bf16/fp16 (no autocast copies of
        the matmul weights): what the advisor's activation estimate counts."""
        return False


def state(held: dict, gathered: float = 0.0, cpu: dict | None = None) -> dict:
    """A model_state result: bytes held on the device per part, the transient gathered copy,
    and what sits in CPU RAM."""
    cpu = cpu or {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    return {**held, "gathered": gathered, "cpu_offloaded": sum(cpu.values()), "cpu_parts": cpu}


def precision_layout(precision: str) -> str:
    return "mixed" if is_mixed(precision) else "fp32"


class ModelParallelSettings(StrategySettings):
    """Tensor and pipeline parallel: the ranks split the model itself, so the model family must
    say how (family_refusal, read through distlab.configuration.families), LoRA is refused, and each rank's
    checkpoint is a shard. Their memory formulas are their own (no advisor row)."""

    data_parallel = False
    splits_by_family_plan = True

    def check(self, spec, config, fail, shape):
        if spec.method != "full":
            fail("method", f"{spec.strategy} runs full fine-tuning only (LoRA would wrap the split layers)")
        self.check_shape(spec, fail, shape)

    def check_shape(self, spec: SpecFields, fail, shape: dict) -> None:
        """fail(field, why) for a model shape the split cannot take."""

    def shards_checkpoint(self, spec):
        return True

    dcp_checkpoint = True

    def advisor_row(self, spec):
        return self.name


def block_schema(properties: dict) -> dict:
    """A strategy's `<name>:` block as JSON Schema: these keys, no others."""
    return {"type": "object", "additionalProperties": False, "properties": properties}


def registered() -> dict[str, StrategySettings]:
    """{name: settings} of every distlab/configuration/strategies/<name>_settings.py, by name (the package's
    search path, read from the package itself: Python imports it before any module in it, so
    this module needs no import of it)."""
    return _discover(tuple(sys.modules[__package__].__path__))


@functools.lru_cache(maxsize=4)
def _discover(path: tuple[str, ...]) -> dict[str, StrategySettings]:
    return discover(__package__, path, "SETTINGS", suffix=SUFFIX)


def strategy_names() -> list[str]:
    """Every strategy with a settings file, by name."""
    return list(registered())


def strategy_key(spec: SpecFields) -> str:
    """Which strategy module runs a spec: FSDP requested through Accelerate is Accelerate's to run."""
    settings = registered().get(spec.strategy)
    return settings.runs_as(spec) if settings else spec.strategy


def settings_for(spec: SpecFields) -> StrategySettings:
    return registered()[spec.strategy]


def advisor_rows() -> dict[str, tuple[str, dict]]:
    """{advisor row: (strategy, its settings block)}: what each row of distlab.tools.advisor stands
    for, as distlab runs it (each strategy's `advisor_rows`)."""
    return {row: (name, block) for name, s in registered().items() for row, block in s.advisor_rows.items()}


def data_parallel(spec: SpecFields) -> bool:
    """Whether the spec's ranks read different samples (a strategy no longer registered: yes)."""
    known = registered().get(spec.strategy)
    return known.data_parallel if known else True


def strategy_defaults() -> dict:
    """Every strategy's settings block, as each experiment inherits it (deep copies)."""
    return {name: copy.deepcopy(s.defaults) for name, s in registered().items() if s.defaults is not None}


def schema_mismatch(schema: dict) -> str | None:
    """Why config/schema.yaml's experiment does not match the registered strategies (its
    strategy enum names exactly them; each one's settings have a block with their keys), or None."""
    experiment = schema["$defs"]["experiment"]["properties"]
    enum, known = set(experiment["strategy"]["enum"]), registered()
    if enum != set(known):
        return (f"its strategy enum {sorted(enum)} differs from the strategies in distlab/configuration/strategies/"
                f"*{SUFFIX}.py {sorted(known)}")
    for name, s in known.items():
        block = set(experiment.get(name, {}).get("properties", {}))
        if s.defaults is not None and not set(s.defaults) <= block:
            return (f"strategy '{name}' has settings {sorted(s.defaults)} but the experiment's '{name}' block "
                    f"declares {sorted(block)}")
    return None


def sharded_counts(counts: dict, n: int, how: str) -> tuple[float, float]:
    """(all, trainable) parameters one of n ranks holds once sharded, padding included:
    ZeRO-3 pads each flattened parameter to a multiple of n; FSDP2 pads dim 0."""
    shapes = counts.get("_shapes")
    if not shapes or n == 1:
        return counts["total"] / n, counts["trainable"] / n
    total = trainable = 0
    for shape, grad in shapes:
        numel = math.prod(shape)
        if how == "fsdp" and shape:
            local = math.ceil(shape[0] / n) * (numel // shape[0] if shape[0] else 0)
        else:
            local = math.ceil(numel / n)
        total += local
        trainable += local if grad else 0
    return total, trainable
