"""Config loading, validation and expansion into fully resolved experiment specs.

Imported by the Snakefile at parse time, so it must stay light: no torch, no transformers
(a no-op `snakemake` rerun has to answer in well under two seconds).

Longer than ~300 lines on purpose: every semantic rule of the schema sits beside the
expansion into specs it guards (the schema file holds the types, this module the relations),
except a strategy's own settings: their defaults, id part and refusals sit beside the strategy
(distlab/configuration/strategies/<name>_settings.py), read here through distlab.configuration.strategies.settings.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from distlab.configuration import families
from distlab.configuration.axes import OPT_IN_STAGES, STAGE_ORDER  # the stages (declared there), re-exported
from distlab.configuration import finetune_config
from distlab.configuration import input_checks
from distlab.configuration import schema as schema_file
from distlab.configuration.config_links import check_unequal_and_link, link_label, machine_refusal, with_link_caps
from distlab.configuration.input_checks import ConfigError
from distlab.configuration.schema import load_schema  # also this module's name for it: validate_schema reads it here
from distlab.records.spec import Spec, SpecDraft, SpecFields
from distlab.configuration.training_tools import adapts, check_training_tools
from distlab.configuration.strategies.settings import (registered, schema_mismatch, settings_for, strategy_defaults,
                                                       strategy_key)
from distlab.configuration.tasks.declaration import DEFAULT_TASK, declaration_for, declaration_named, task_names

# The one place every experiment inherits from. config.yaml's `defaults:` overrides these,
# and each experiment overrides that.
EXPERIMENT_DEFAULTS: dict = {
    "tag": None,
    "task": DEFAULT_TASK,
    "strategy": "ddp",
    "launcher": "auto",
    "method": "full",
    "world_size": 1,
    "micro_batch": 4,
    "grad_accum": 1,
    "seq_len": 128,
    # A run's length: exactly one of steps, epochs, max_tokens (LENGTH_KEYS); the others None.
    "steps": 30,
    "epochs": None,
    "max_tokens": None,
    "untimed_steps": 5,
    "precision": "fp32",
    "seed": 1234,
    "lr": 3.0e-4,
    "weight_decay": 0.0,
    # Fine-tuning controls (distlab.runtime.schedule, distlab.runtime.clipping, distlab.runtime.activations,
    # distlab.rank.monitor).
    "lr_schedule": "constant",
    "lr_warmup_steps": 0,
    "lr_warmup_ratio": None,
    "max_grad_norm": 0.0,
    "activation_checkpointing": "none",
    "activation_checkpointing_every": 2,
    "progress_every_s": 30.0,
    "tracking": [],
    "eval_every": 0,
    "checkpoint_select": "last",
    "sampler": "distributed",
    "device": "auto",
    "cpu_threads_per_rank": 1,
    "repeats": 1,
    "launches": 1,
    "checkpoint_every": 0,
    "checkpoint_keep": 1,
    "export": {"merge": False, "max_shard_size": "5GB"},
    "memory_budget_gib": None,
    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None},
    # Training tools (distlab.configuration.training_tools): regional compilation, profiler traces.
    "compile": False,
    "profile": None,
    **strategy_defaults(),  # each strategy's own block (`deepspeed`, `fsdp`, `pp`): strategies/<name>_settings.py
    "ray": {"address": None, "min_workers": None, "max_failures": 0, "storage_path": None, "resize_interval_s": 60.0},
    "link": None,
    "rank_micro_batch": None,
    "rank_cpu_threads": None,
    "rank_cpu_budget": None,
}


def experiment_defaults() -> dict:
    """EXPERIMENT_DEFAULTS with the settings of every strategy registered now (one added after
    this module was imported comes last)."""
    return {**EXPERIMENT_DEFAULTS, **strategy_defaults()}



def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# Top-level switches a user sets with `snakemake --config key=value`: Snakemake's parser turns
# only "True"/"False" into booleans and leaves "false" a string (snakemake.cli.parse_config).
COMMAND_LINE_BOOLEANS = ("warm_start",)
BOOLEAN_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _command_line_booleans(config: dict) -> None:
    """`--config warm_start=false` as the boolean it spells (YAML's words, any case), in place."""
    for key in COMMAND_LINE_BOOLEANS:
        value = config.get(key)
        if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
            config[key] = BOOLEAN_WORDS[value.lower()]


def validate_schema(config: dict) -> dict:
    """Validate against config/schema.yaml and fill the schema's defaults (in place)."""
    _command_line_booleans(config)
    schema = load_schema()
    mismatch = schema_mismatch(schema)  # a strategy added without its schema entry, or the reverse
    if mismatch:
        raise ConfigError(f"{schema_file.SCHEMA_PATH}: {mismatch}")
    # Strict types: JSON Schema alone counts 2.0 as an integer and NaN as a number.
    errors = sorted(input_checks.StrictValidator(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        lines = []
        for err in errors:
            where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
            lines.append(f"config field '{where}': {err.message}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines))
    _fill_defaults(config, schema)
    return config


def _fill_defaults(instance, schema):
    """Apply `default:` values of object properties recursively (jsonschema does not)."""
    if not isinstance(instance, dict) or schema.get("type") not in (None, "object"):
        return
    for key, sub in schema.get("properties", {}).items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if key in instance:
            _fill_defaults(instance[key], sub)


def variant(spec: SpecFields) -> str:
    """The strategy-specific part of an experiment id (e.g. `z3-offopt`)."""
    return settings_for(spec).variant(spec)


def experiment_id(spec: SpecFields) -> str:
    parts = [spec.strategy]
    extra = variant(spec)
    if extra:
        parts.append(extra)
    sized = spec.rank_micro_batch
    batch = spec.micro_batch if sized is None else sized if sized == "auto" else "x".join(map(str, sized))
    parts += [spec.method, f"w{spec.world_size}", f"mb{batch}", f"ga{spec.grad_accum}"]
    if spec.compile:
        parts.append("compiled")
    if spec.launcher == "ray":
        parts.append("ray")
    if spec.rank_cpu_threads:
        parts.append("threads" + "x".join(map(str, spec.rank_cpu_threads)))
    if spec.rank_cpu_budget:
        parts.append("cores" + "x".join(f"{c:g}" for c in spec.rank_cpu_budget))
    if spec.link:
        parts.append("link" + link_label(spec.link["bandwidth_mbit"]))
    task_part = declaration_for(spec).id_part()
    if task_part:
        parts.append(task_part)
    if spec.tag:
        parts.append(spec.tag)
    return "-".join(parts)


def resolve_launcher(spec: SpecFields) -> str:
    if spec.launcher != "auto":
        return spec.launcher
    return registered()[strategy_key(spec)].launcher


def accelerate_runs(spec: SpecFields) -> bool:
    """Experiments the Accelerate strategy runs: its own, and FSDP requested through it."""
    return strategy_key(spec) == "accelerate"


def expand_experiments(config: dict, gpu_count: int | None = None) -> dict[str, Spec]:
    """Every enabled experiment as {id: fully resolved spec}, in roadmap order.

    gpu_count resolves device 'auto' (cuda when GPUs exist); None means "detect".
    """
    if gpu_count is None:
        from distlab.configuration.hardware import gpu_count as detect

        gpu_count = detect()
    defaults = finetune_config.layer(config.get("defaults", {}), "defaults")
    base = _deep_merge(finetune_config.over(experiment_defaults(), defaults), defaults)
    specs: dict[str, dict] = {}
    stages = config.get("stages", {})
    for stage in STAGE_ORDER:
        block = stages.get(stage)
        if not block or not block.get("enabled", True):
            continue
        for index, override in with_link_caps(block, base):
            override = finetune_config.layer(override, f"stages.{stage}.experiments[{index}]")
            spec = SpecDraft(_deep_merge(finetune_config.over(base, override), override))
            spec["stage"] = stage
            spec["launcher"] = resolve_launcher(spec)
            if spec.launcher == "ray":
                for key in ("address", "storage_path"):  # the cluster-wide `ray:` block fills what is unset
                    if spec.ray[key] is None:
                        spec["ray"][key] = config.get("ray", {}).get(key)
            if spec.device == "auto":
                spec["device"] = "cuda" if gpu_count > 0 else "cpu"
            declaration_for(spec).resolve(spec, config)  # the task's settings this run depends on
            where = f"stages.{stage}.experiments[{index}]"
            exp_id = experiment_id(spec)
            spec["id"] = exp_id
            if exp_id in specs:
                raise ConfigError(
                    f"config field '{where}': experiment id '{exp_id}' is used twice "
                    f"(also by stage '{specs[exp_id]['stage']}'); give one of them a distinct `tag`"
                )
            check_experiment(spec, config, where, gpu_count)
            refused = machine_refusal(spec) if stage not in OPT_IN_STAGES else None
            if refused:
                raise ConfigError(f"config field '{where}.{refused[0]}': {refused[1]}")
            specs[exp_id] = Spec(spec)  # frozen from here on: a change is a new spec (spec.replace)
    return specs


def check_experiment(spec: SpecFields, config: dict, where: str, gpu_count: int) -> None:
    """Semantic checks the schema cannot express; each error names the field."""

    def fail(field, message):
        raise ConfigError(f"config field '{where}.{field}': {message}")

    task, strategy = declaration_for(spec), settings_for(spec)
    # First what cannot run at all: the strategy's refusal of the task (declared beside the
    # strategy, so no task lists strategies), then the task's own.
    strategy.check_task(task, spec, fail)
    task.check_experiment(spec, config, fail)
    finetune_config.resolve_length(spec)  # epochs: steps stay None until the data exists (rules/common.smk)
    if spec.steps is not None:
        finetune_config.check_length(spec, fail)
    finetune_config.check_finetune(spec, fail)
    check_training_tools(spec, fail)  # method qlora, compile, profile: where each cannot run, and why
    model = spec.model
    if model != "default" and model not in config.get("model", {}).get("extra", {}):
        fail("model", f"no model named '{model}': the default or one of model.extra "
             f"({', '.join(sorted(config.get('model', {}).get('extra', {}))) or 'none declared'})")
    max_pos = model_max_positions(config, spec)
    if max_pos is not None and spec.seq_len > max_pos:
        fail("seq_len", f"sequence length {spec.seq_len} exceeds the model's max_position_embeddings ({max_pos})")
    if spec.device == "cuda" and gpu_count < spec.world_size and spec.launcher != "ray":
        fail("device", f"cuda with world_size {spec.world_size} needs that many GPUs; {gpu_count} found")
    families.check(spec, config, fail, strategy)  # a model-splitting strategy x a model.path folder's family
    strategy.check(spec, config, fail, model_shape(config, spec))  # the strategy's own refusals
    if spec.export["merge"] and not adapts(spec):
        fail("export.merge", "merging applies to LoRA adapters; a full fine-tune's export is the whole model already")
    if spec.precision == "fp16" and spec.device == "cpu":
        fail("precision", "fp16 autocast is not supported on CPU; use fp32 or bf16")
    if spec.launcher == "ray" and not strategy.ray_train:
        ray_ones = [name for name, s in registered().items() if s.ray_train]
        fail("launcher", f"Ray Train sets up the process group for {', '.join(ray_ones)}, not {spec.strategy}")
    ray = spec.ray
    if spec.launcher != "ray" and (ray["min_workers"] is not None or ray["max_failures"]):
        fail("ray", "min_workers and max_failures are Ray Train settings; they need launcher: ray")
    if ray["min_workers"] is not None and ray["min_workers"] > spec.world_size:
        fail("ray.min_workers", f"elastic lower bound {ray['min_workers']} exceeds world_size {spec.world_size} "
             "(the upper bound)")
    if spec.launcher == "ray" \
            and (ray["max_failures"] or (ray["min_workers"] or spec.world_size) < spec.world_size) \
            and not spec.checkpoint_every:
        fail("checkpoint_every", "a Ray run that recovers from failures or resizes resumes from its last "
             "checkpoint; set checkpoint_every > 0")
    if spec.launcher == "ray" and accelerate_runs(spec):
        fail("launcher", "FSDP through Accelerate starts from accelerate launch (or torchrun), not Ray Train")
    if spec.launcher == "accelerate" and not accelerate_runs(spec):
        fail("launcher", f"accelerate launch starts the accelerate strategy (and fsdp with via: accelerate), "
             f"not {spec.strategy}; use torchrun")
    check_unequal_and_link(spec, fail)


def built_model(config: dict, name: str) -> dict:
    """The build block of a model.extra entry: `model.build` with the entry's keys over it."""
    model = config.get("model", {})
    return _deep_merge(model.get("build", {}), model.get("extra", {})[name].get("build", {}))


def model_shape(config: dict, spec: SpecFields | None = None) -> dict:
    """The shape of the model an experiment fine-tunes (spec None or no `model` key: the base
    model): a model.extra entry's build, the base model's config.json when a local path is
    given, else `model.build`."""
    model = config.get("model", {})
    name = (spec or {}).get("model", "default")
    if name != "default":
        return built_model(config, name)
    if model.get("path"):
        cfg = Path(model["path"]) / "config.json"
        if cfg.is_file():
            with open(cfg) as fh:
                return json.load(fh)
        return {}
    if model.get("hub_id"):
        return {}
    return model.get("build", {})


def model_max_positions(config: dict, spec: SpecFields | None = None):
    return model_shape(config, spec).get("max_position_embeddings")


def check_config(config: dict) -> None:
    """Checks across fields, run before any experiment is expanded."""
    input_checks.check_results_dir(config["results_dir"])
    input_checks.check_machine(config["machine"])
    model = config["model"]
    if model.get("path") and model.get("hub_id"):
        raise ConfigError("config field 'model.hub_id': set either model.path or model.hub_id, not both")
    if model.get("path"):
        path = Path(model["path"])
        if not path.is_dir():
            raise ConfigError(f"config field 'model.path': model folder '{path}' does not exist")
        if not (path / "config.json").is_file():
            raise ConfigError(f"config field 'model.path': '{path}' has no config.json (not a Hugging Face model "
                              "folder)")
        input_checks.model_config(path)
    if model.get("extra") and model.get("hub_id") and not config["data"]["tokenizer"]:
        raise ConfigError("config field 'model.extra': a built model takes the data's tokenizer file; with "
                          "model.hub_id set data.tokenizer names none")
    builds = [("model.build", model["build"])] + [(f"model.extra.{name}.build", built_model(config, name))
                                                  for name in model.get("extra", {})]
    for where, build in builds:
        if build["hidden_size"] % build["num_attention_heads"]:
            raise ConfigError(f"config field '{where}.num_attention_heads': hidden_size "
                              f"{build['hidden_size']} is not divisible by {build['num_attention_heads']} heads")
        if build["num_attention_heads"] % build["num_key_value_heads"]:
            raise ConfigError(f"config field '{where}.num_key_value_heads': num_attention_heads must be a "
                              "multiple of num_key_value_heads")
    data = config["data"]
    if data["source"] == "files":
        if not data["files"]:
            raise ConfigError("config field 'data.files': source 'files' needs at least one file")
        for index, name in enumerate(data["files"]):
            if not os.path.isfile(name):
                raise ConfigError(f"config field 'data.files[{index}]': file '{name}' does not exist")
    if data["source"] == "hf" and not data["hf_name"]:
        raise ConfigError("config field 'data.hf_name': source 'hf' needs a dataset name")
    if data["tokenizer"] and not os.path.exists(data["tokenizer"]):
        raise ConfigError(f"config field 'data.tokenizer': '{data['tokenizer']}' does not exist")
    # files readable with their fields
    from distlab.configuration.data_checks import check_data, check_experiment_datasets
    from distlab.configuration.tokenizer_checks import check_tokenizer  # the tokenizer fits the model

    check_data(config)
    check_tokenizer(config)
    check_experiment_datasets(config)
    for name in task_names():  # a task's own config block: its model folder, its data files
        declaration_named(name).check_config(config)
    for index, extra in enumerate(config["extra_results"]):
        input_checks.refuse_wildcard_braces(f"extra_results[{index}]", extra)
        if not os.path.isdir(extra):
            raise ConfigError(f"config field 'extra_results[{index}]': folder '{extra}' does not exist")


def load(config: dict, gpu_count: int | None = None, probe: bool = False) -> tuple[dict, dict[str, dict]]:
    """Validate a config dict and expand it: returns (config with defaults, specs by id).
    probe: also check what the jobs will need of this machine (results_dir writable, Ray heads
    reachable, the model folder's weights present)."""
    validate_schema(config)
    check_config(config)
    specs = expand_experiments(config, gpu_count)
    if not specs:
        raise ConfigError("config field 'stages': no enabled experiment; nothing to run")
    if probe:
        input_checks.check_results_dir(config["results_dir"], probe=True)
        input_checks.check_ray_heads(specs)
        if config["model"].get("path"):
            input_checks.model_config(config["model"]["path"], weights=True)
    return config, specs


def load_file(path: str | os.PathLike, gpu_count: int | None = None):
    return load(input_checks.yaml_file(path), gpu_count)
