"""Which experiments' checkpoints get a validation job (`validation.scope`), and what makes two
checkpoints the same format. Light like distlab.configuration.config: the Snakefile imports it."""
from __future__ import annotations

from distlab.records.spec import SpecFields
from distlab.configuration.strategies.settings import settings_for, strategy_key


def validated_experiments(config: dict, specs: dict[str, dict]) -> list[str]:
    """Ids whose checkpoints get a validation job, per `validation.scope`."""
    scope = config.get("validation", {}).get("scope", "per_format")
    if scope == "none":
        return []
    if scope == "all":
        return list(specs)
    if scope == "sharded":
        specs = {exp_id: spec for exp_id, spec in specs.items() if shards_checkpoint(spec)}
    chosen, seen = [], set()
    # A run held to memory_budget_gib may end as oom and save nothing (its validation would
    # have nothing to check), so a format is represented by an unbudgeted run where one exists.
    for exp_id, spec in sorted(specs.items(), key=lambda item: item[1].get("memory_budget_gib") is not None):
        key = (spec.task, spec.strategy, spec.method, spec.launcher, strategy_key(spec))
        if scope in ("per_format", "sharded"):
            key += (checkpoint_format(spec),)
        if key not in seen:
            seen.add(key)
            chosen.append(exp_id)
    return [exp_id for exp_id in specs if exp_id in chosen]


def shards_checkpoint(spec: SpecFields) -> bool:
    """Whether the run's checkpoint holds per-rank shards (validation scope 'sharded')."""
    return settings_for(spec).shards_checkpoint(spec)


def checkpoint_format(spec: SpecFields) -> tuple:
    """What changes the checkpoint a run writes (ZeRO stage and offload, FSDP variant, precision)
    beyond strategy x method x launcher; world size and batch shape do not (each strategy's
    settings file says which of its settings do)."""
    return settings_for(spec).checkpoint_format(spec)
