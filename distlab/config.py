"""Config loading, validation and expansion into fully resolved experiment specs.

Imported by the Snakefile at parse time, so it must stay light: no torch, no transformers
(a no-op `snakemake` rerun has to answer in well under two seconds).

Longer than ~300 lines on purpose: every semantic rule of the schema sits beside the
expansion into specs it guards (the schema file holds the types, this module the relations).
"""
from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

import yaml

from distlab import families
from distlab import finetune_config
from distlab import input_checks
from distlab.config_links import check_unequal_and_link, link_label, machine_refusal, with_link_caps
from distlab.input_checks import ConfigError
from distlab.tasks import task_for, task_named, task_names

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"

# The one place every experiment inherits from. config.yaml's `defaults:` overrides these,
# and each experiment overrides that.
EXPERIMENT_DEFAULTS: dict = {
    "tag": None,
    "task": "causal-lm",
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
    # Fine-tuning controls (distlab.schedule, distlab.clipping, distlab.activations, distlab.monitor).
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
    "deepspeed": {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "nvme_path": None,
                  "optimizer_impl": "torch", "zero3_profile": "auto"},
    "fsdp": {"reshard_after_forward": True, "cpu_offload": False, "via": "native"},
    "pp": {"schedule": "gpipe", "microbatches": 4},
    "ray": {"address": None, "min_workers": None, "max_failures": 0, "storage_path": None, "resize_interval_s": 60.0},
    "link": None,
    "rank_micro_batch": None,
    "rank_cpu_threads": None,
    "rank_cpu_budget": None,
}

# Roadmap order; the report shows stages in this order.
STAGE_ORDER = ["ddp", "accelerate", "deepspeed", "fsdp", "ray", "parallel", "links", "unequal"]
# Built only by their own targets (`snakemake links`, `snakemake unequal`), never by the default run.
OPT_IN_STAGES = ("links", "unequal")


def load_schema() -> dict:
    """config/schema.yaml (a copy: callers may change theirs). Parsed once per process and file
    version: expanding the default config asks for it ~170 times (each experiment's task and
    strategy names), which cost 8 s of YAML parsing in every `snakemake` call and test."""
    path = Path(SCHEMA_PATH)
    return copy.deepcopy(_parsed_schema(str(path), path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _parsed_schema(path: str, version: int) -> dict:
    with open(path) as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def validate_schema(config: dict) -> dict:
    """Validate against config/schema.yaml and fill the schema's defaults (in place)."""
    schema = load_schema()
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


def variant(spec: dict) -> str:
    """The strategy-specific part of an experiment id (e.g. `z3-offopt`)."""
    strategy = spec["strategy"]
    if strategy == "deepspeed":
        ds = spec["deepspeed"]
        parts = [f"z{ds['zero_stage']}"]
        if ds["offload_optimizer"] != "none":
            parts.append(f"offopt{'' if ds['offload_optimizer'] == 'cpu' else '.nvme'}")
        if ds["offload_param"] != "none":
            parts.append(f"offparam{'' if ds['offload_param'] == 'cpu' else '.nvme'}")
        if ds["optimizer_impl"] == "deepspeed":
            parts.append("dsadam")
        if ds["zero3_profile"] == "lean":
            parts.append("lean")
        return "-".join(parts)
    if strategy == "fsdp":
        fs = spec["fsdp"]
        # "fullshard", not "full": the method part of the id is already "full"/"lora".
        parts = ["fullshard" if fs["reshard_after_forward"] else "gradop"]
        if fs["cpu_offload"]:
            parts.append("offload")
        if fs["via"] == "accelerate":
            parts.append("acc")
        return "-".join(parts)
    if strategy == "pp":
        return f"{spec['pp']['schedule']}-m{spec['pp']['microbatches']}"
    return ""


def experiment_id(spec: dict) -> str:
    parts = [spec["strategy"]]
    extra = variant(spec)
    if extra:
        parts.append(extra)
    sized = spec.get("rank_micro_batch")
    batch = spec["micro_batch"] if sized is None else sized if sized == "auto" else "x".join(map(str, sized))
    parts += [spec["method"], f"w{spec['world_size']}", f"mb{batch}", f"ga{spec['grad_accum']}"]
    if spec["launcher"] == "ray":
        parts.append("ray")
    if spec.get("rank_cpu_threads"):
        parts.append("threads" + "x".join(map(str, spec["rank_cpu_threads"])))
    if spec.get("rank_cpu_budget"):
        parts.append("cores" + "x".join(f"{c:g}" for c in spec["rank_cpu_budget"]))
    if spec.get("link"):
        parts.append("link" + link_label(spec["link"]["bandwidth_mbit"]))
    task_part = task_for(spec).id_part()
    if task_part:
        parts.append(task_part)
    if spec.get("tag"):
        parts.append(spec["tag"])
    return "-".join(parts)


def resolve_launcher(spec: dict) -> str:
    if spec["launcher"] != "auto":
        return spec["launcher"]
    return "accelerate" if accelerate_runs(spec) else "torchrun"


def accelerate_runs(spec: dict) -> bool:
    """Experiments the Accelerate strategy runs: its own, and FSDP requested through it."""
    return spec["strategy"] == "accelerate" or (spec["strategy"] == "fsdp" and spec["fsdp"]["via"] == "accelerate")


def expand_experiments(config: dict, gpu_count: int | None = None) -> dict[str, dict]:
    """Every enabled experiment as {id: fully resolved spec}, in roadmap order.

    gpu_count resolves device 'auto' (cuda when GPUs exist); None means "detect".
    """
    if gpu_count is None:
        from distlab.hardware import gpu_count as detect

        gpu_count = detect()
    defaults = finetune_config.layer(config.get("defaults", {}), "defaults")
    base = _deep_merge(finetune_config.over(EXPERIMENT_DEFAULTS, defaults), defaults)
    specs: dict[str, dict] = {}
    stages = config.get("stages", {})
    for stage in STAGE_ORDER:
        block = stages.get(stage)
        if not block or not block.get("enabled", True):
            continue
        for index, override in with_link_caps(block, base):
            override = finetune_config.layer(override, f"stages.{stage}.experiments[{index}]")
            spec = _deep_merge(finetune_config.over(base, override), override)
            spec["stage"] = stage
            spec["launcher"] = resolve_launcher(spec)
            if spec["launcher"] == "ray":
                for key in ("address", "storage_path"):  # the cluster-wide `ray:` block fills what is unset
                    if spec["ray"][key] is None:
                        spec["ray"][key] = config.get("ray", {}).get(key)
            if spec["device"] == "auto":
                spec["device"] = "cuda" if gpu_count > 0 else "cpu"
            task_for(spec).resolve(spec, config)  # the task's settings this run depends on
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
            specs[exp_id] = spec
    return specs


def check_experiment(spec: dict, config: dict, where: str, gpu_count: int) -> None:
    """Semantic checks the schema cannot express; each error names the field."""

    def fail(field, message):
        raise ConfigError(f"config field '{where}.{field}': {message}")

    task_for(spec).check_experiment(spec, config, fail)  # first: what the task cannot run at all
    finetune_config.resolve_length(spec)  # epochs: steps stay None until the data exists (rules/common.smk)
    if spec["steps"] is not None:
        finetune_config.check_length(spec, fail)
    finetune_config.check_finetune(spec, fail)
    model = spec.get("model", "default")
    if model != "default" and model not in config.get("model", {}).get("extra", {}):
        fail("model", f"no model named '{model}': the default or one of model.extra "
             f"({', '.join(sorted(config.get('model', {}).get('extra', {}))) or 'none declared'})")
    max_pos = model_max_positions(config, spec)
    if max_pos is not None and spec["seq_len"] > max_pos:
        fail("seq_len", f"sequence length {spec['seq_len']} exceeds the model's max_position_embeddings ({max_pos})")
    if spec["device"] == "cuda" and gpu_count < spec["world_size"] and spec["launcher"] != "ray":
        fail("device", f"cuda with world_size {spec['world_size']} needs that many GPUs; {gpu_count} found")
    if spec["strategy"] == "deepspeed":
        ds = spec["deepspeed"]
        if ds["offload_param"] != "none" and ds["zero_stage"] != 3:
            fail("deepspeed.offload_param", "parameter offload needs zero_stage 3")
        if ds["offload_optimizer"] != "none" and ds["zero_stage"] == 0:
            fail("deepspeed.offload_optimizer", "optimizer offload needs zero_stage 1, 2 or 3")
        if ds["zero3_profile"] != "auto" and ds["zero_stage"] != 3:
            fail("deepspeed.zero3_profile", f"{ds['zero3_profile']} sets ZeRO-3's gathered parameters: needs zero_stage 3")
        if "nvme" in (ds["offload_optimizer"], ds["offload_param"]) and not ds["nvme_path"]:
            fail("deepspeed.nvme_path", "NVMe offload needs a nvme_path folder")
    if model == "default":  # model.extra entries are built Llamas (checked in check_config)
        families.check(spec, config, fail)  # family x strategy, from the model folder's own config
    if spec["strategy"] in ("tp", "pp") and spec["method"] != "full":
        fail("method", f"{spec['strategy']} runs full fine-tuning only (LoRA would wrap the split layers)")
    if spec["strategy"] == "tp":
        heads = model_shape(config, spec).get("num_attention_heads")
        kv_heads = model_shape(config, spec).get("num_key_value_heads", heads)
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count is not None and count % spec["world_size"]:
                fail("world_size", f"tensor parallel degree {spec['world_size']} does not divide the model's "
                     f"{name} ({count})")
    if spec["strategy"] == "pp":
        layers = model_shape(config, spec).get("num_hidden_layers")
        if layers is not None and layers < spec["world_size"]:
            fail("world_size", f"pipeline of {spec['world_size']} stages needs at least that many decoder "
                 f"layers; the model has {layers}")
        if spec["world_size"] > 1 and model_shape(config, spec).get("tie_word_embeddings"):
            fail("world_size", "pipeline stages cannot share the tied input/output embedding of this model "
                 "(tie_word_embeddings true); use world_size 1 or an untied model")
        if spec["micro_batch"] % spec["pp"]["microbatches"]:
            fail("pp.microbatches", f"micro_batch {spec['micro_batch']} must divide into "
                 f"{spec['pp']['microbatches']} pipeline micro-batches")
    if spec["fsdp"]["via"] == "accelerate" and spec["strategy"] == "fsdp" and spec["device"] != "cuda":
        fail("fsdp.via", "FSDP through Accelerate is a CUDA path (on CPU Accelerate wraps DDP instead); "
             "use via: native")
    if spec["export"]["merge"] and spec["method"] != "lora":
        fail("export.merge", "merging applies to LoRA adapters; a full fine-tune's export is the whole model already")
    if spec["precision"] == "fp16" and spec["device"] == "cpu":
        fail("precision", "fp16 autocast is not supported on CPU; use fp32 or bf16")
    if spec["launcher"] == "ray" and spec["strategy"] not in ("ddp", "fsdp", "deepspeed"):
        fail("launcher", f"Ray Train sets up the process group for ddp, fsdp and deepspeed, not {spec['strategy']}")
    ray = spec["ray"]
    if spec["launcher"] != "ray" and (ray["min_workers"] is not None or ray["max_failures"]):
        fail("ray", "min_workers and max_failures are Ray Train settings; they need launcher: ray")
    if ray["min_workers"] is not None and ray["min_workers"] > spec["world_size"]:
        fail("ray.min_workers", f"elastic lower bound {ray['min_workers']} exceeds world_size {spec['world_size']} "
             "(the upper bound)")
    if spec["launcher"] == "ray" and (ray["max_failures"] or (ray["min_workers"] or spec["world_size"]) < spec["world_size"]) \
            and not spec["checkpoint_every"]:
        fail("checkpoint_every", "a Ray run that recovers from failures or resizes resumes from its last "
             "checkpoint; set checkpoint_every > 0")
    if spec["launcher"] == "ray" and accelerate_runs(spec):
        fail("launcher", "FSDP through Accelerate starts from accelerate launch (or torchrun), not Ray Train")
    if spec["launcher"] == "accelerate" and not accelerate_runs(spec):
        fail("launcher", f"accelerate launch starts the accelerate strategy (and fsdp with via: accelerate), "
             f"not {spec['strategy']}; use torchrun")
    check_unequal_and_link(spec, fail)


def built_model(config: dict, name: str) -> dict:
    """The build block of a model.extra entry: `model.build` with the entry's keys over it."""
    model = config.get("model", {})
    return _deep_merge(model.get("build", {}), model.get("extra", {})[name].get("build", {}))


def model_shape(config: dict, spec: dict | None = None) -> dict:
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


def model_max_positions(config: dict, spec: dict | None = None):
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
            raise ConfigError(f"config field 'model.path': '{path}' has no config.json (not a Hugging Face model folder)")
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
    from distlab.data_checks import check_data  # data files readable with their fields; tokenizer fits the model

    check_data(config)
    for name in task_names():  # a task's own config block: its model folder, its data files
        task_named(name).check_config(config)
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
