"""One experiment's resolved settings as a frozen, checked type (`Spec`).

A spec is built once, at the door (config expansion, a job file read), and never changed in
passing afterwards: a rank or a validation launch that needs other settings makes a new spec
with `spec.replace(key=value)` and says so where it does.

Why a frozen *dict* and not a dataclass: the spec's fields are the experiment keys of
config/schema.yaml (the one place they are described and checked), and three consumers need a
plain mapping: Snakemake's `params` (it reruns a job when the param's `repr` changes, and it
only looks at dict/list/str... values: any other type would be ignored, so an edited
experiment would not rerun), `json.dumps` (job.json, metrics.json) and YAML dumps of the
generated configs. `FrozenDict` keeps dict's repr, JSON and pickling and refuses every change.

Code reads a spec's fields as typed attributes, never as dict keys: `spec.world_size`,
`spec.deepspeed.zero_stage`. `SpecFields` declares every field with its type (the schema's
experiment keys plus what expansion resolves; tests/test_spec_job.py holds the two to each
other), so a misspelt field is an AttributeError naming it, where `spec.wrold_size` was a
silent None. Nested blocks (a strategy's settings, lora, ray, export, link, profile, length)
are `Block`s, read the same way. The mapping side stays for the doors only: Snakemake params,
JSON and YAML dumps, Ray's pickling.
"""
from __future__ import annotations

from collections.abc import Mapping

import yaml


def _refuse(self, *args, **kwargs):
    raise TypeError(f"a {type(self).__name__} is frozen: build a new one "
                    "(spec.replace(key=value)) instead of changing it in place")


def freeze(value):
    """Nested dicts as Blocks (FrozenDicts read by attribute) and lists as FrozenLists (other
    values as they are)."""
    if isinstance(value, FrozenDict) or isinstance(value, FrozenList):
        return value
    if isinstance(value, Mapping):
        return Block(value)
    if isinstance(value, list):
        return FrozenList(value)
    return value


def thaw(value):
    """A plain, mutable deep copy: dicts and lists (tuples read from frozen records too)."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


class FrozenDict(dict):
    """A dict that refuses every change after it is built; its nested dicts and lists are frozen
    too. repr, ==, json.dumps and pickling are dict's."""
    __slots__ = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, item in dict.items(self):
            dict.__setitem__(self, key, freeze(item))

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):  # pickle (Ray) rebuilds through __init__, never item by item
        return type(self), (dict(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class FrozenList(list):
    """A list that refuses every change after it is built (repr and JSON are list's)."""
    __slots__ = ()

    def __init__(self, items=()):
        super().__init__(freeze(item) for item in items)

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = remove = pop = clear = sort = reverse = _refuse

    def __reduce__(self):
        return type(self), (list(self),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Block(FrozenDict):
    """A nested block of a spec or record (a strategy's settings, lora, ray, export, link...):
    its keys read as attributes (`spec.deepspeed.zero_stage`); a key it lacks is an
    AttributeError naming it and what the block holds. A key that is a Python keyword
    (`length["from"]`) is read as an item."""
    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"this block has no field {name!r} (it holds {', '.join(sorted(self))})") from None


class SpecFields:
    """The typed fields of one experiment's spec, read as attributes. The names are the
    experiment keys of config/schema.yaml, plus id and stage (config expansion) and length
    (finetune_config.resolve_length); each strategy's own block (`spec.deepspeed`, declared with
    its defaults and schema in distlab/configuration/strategies/<name>_settings.py) is read as a Block of the
    same name. An optional field the spec does not hold reads None. A field that is neither is
    an AttributeError naming it."""
    __slots__ = ()

    # what the experiment is
    id: str
    stage: str
    task: str
    strategy: str
    launcher: str
    method: str
    device: str
    precision: str
    tag: str | None
    dataset: str | None
    model: str | None
    # the batch and its length
    world_size: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    steps: int | None
    epochs: float | None
    max_tokens: int | None
    length: Block
    untimed_steps: int
    warmup_steps: int | None
    seed: int
    sampler: str
    # the optimizer and its schedule
    lr: float
    weight_decay: float
    lr_schedule: str
    lr_warmup_steps: int | None
    lr_warmup_ratio: float | None
    max_grad_norm: float | None
    # what a rank does besides its steps
    activation_checkpointing: str
    activation_checkpointing_every: int
    compile: bool
    profile: Block | None
    progress_every_s: float
    tracking: FrozenList
    eval_every: int
    checkpoint_select: str
    checkpoint_every: int
    checkpoint_keep: int
    export: Block
    memory_budget_gib: float | None
    lora: Block
    # timing
    launches: int
    repeats: int
    # devices, ranks and links
    cpu_threads_per_rank: int
    ray: Block
    link: Block | None
    rank_micro_batch: FrozenList | str | None
    rank_cpu_threads: FrozenList | None
    rank_cpu_budget: FrozenList | None
    # a task's own block (text-to-image's resolved settings)
    text_to_image: Block | None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in SPEC_FIELDS or (name in self and isinstance(dict.get(self, name), Mapping)):
            value = dict.get(self, name, ABSENT_FIELD_VALUES.get(name))
            # A draft (config expansion, before the spec is frozen) holds plain dicts: read
            # them as Blocks too (a frozen copy: a draft's blocks are changed by item).
            return Block(value) if isinstance(value, Mapping) and not isinstance(value, Block) else value
        raise AttributeError(f"a spec has no field {name!r} (the experiment keys: config/schema.yaml)")

    def block(self, name: str) -> Block | None:
        """The block named by a variable (a strategy's settings: `spec.block(self.name)`)."""
        return getattr(self, name) if name in self else None


#: Every declared field's name (the checks above read it; tests hold it to the schema).
SPEC_FIELDS = frozenset(SpecFields.__annotations__)

#: What a field a spec does not hold reads as, where that is not None: a run recorded before
#: tasks existed trained a causal LM; experiments that pick no dataset or model train on the
#: config's `data:` and `model:` ("default"); a spec written before a field existed (a shared
#: results folder) ran one launch of one window.
ABSENT_FIELD_VALUES = {"task": "causal-lm", "dataset": "default", "model": "default", "launches": 1, "repeats": 1,
                       "checkpoint_keep": 1, "tracking": ()}


class SpecDraft(SpecFields, dict):
    """A spec while config expansion still fills it in (mutable, read the same way). It never
    leaves distlab.configuration.config: expansion freezes it into a Spec."""
    __slots__ = ()


# The fields every part of distlab reads without a default: a spec without them (a job file
# edited by hand, one from another version) is refused at the door, naming the field.
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "stage": (str,), "task": (str,), "strategy": (str,), "launcher": (str,), "method": (str,),
    "device": (str,), "precision": (str,), "world_size": (int,), "micro_batch": (int,), "grad_accum": (int,),
    "seq_len": (int,), "seed": (int,), "untimed_steps": (int,),
}


class SpecError(ValueError):
    """A spec that lacks a field every reader needs, or holds it with the wrong type."""


class Spec(SpecFields, FrozenDict):
    """One experiment's resolved settings (the schema's experiment keys plus id, stage and the
    resolved launcher and device), read as typed attributes (SpecFields). Frozen: `replace`
    returns a new Spec."""
    __slots__ = ()

    def replace(self, **changes) -> "Spec":
        return Spec({**self, **changes})

    def to_dict(self) -> dict:
        return thaw(self)

    @classmethod
    def checked(cls, data, where: str) -> "Spec":
        """A Spec from data read at a door (a job file, config expansion), its required fields
        present and typed; else SpecError naming `where` and the field."""
        if not isinstance(data, Mapping):
            raise SpecError(f"{where}: the spec is not an object")
        for name, types in REQUIRED_FIELDS.items():
            value = data.get(name)
            if not isinstance(value, types) or isinstance(value, bool):
                why = "missing" if name not in data else f"{value!r} is not {'/'.join(t.__name__ for t in types)}"
                raise SpecError(f"{where}: spec field '{name}': {why}")
        steps = data.get("steps")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)):
            raise SpecError(f"{where}: spec field 'steps': {steps!r} is not an integer")
        if data["world_size"] < 1 or data["micro_batch"] < 1 or data["grad_accum"] < 1:
            raise SpecError(f"{where}: spec fields world_size/micro_batch/grad_accum must be at least 1")
        return data if isinstance(data, cls) else cls(data)


# Generated config files (Accelerate's YAML) hold spec values: dump frozen ones as plain ones.
for _dumper in (yaml.SafeDumper, yaml.Dumper):
    _dumper.add_representer(FrozenDict, yaml.representer.SafeRepresenter.represent_dict)
    _dumper.add_representer(Block, yaml.representer.SafeRepresenter.represent_dict)
    _dumper.add_representer(Spec, yaml.representer.SafeRepresenter.represent_dict)
    _dumper.add_representer(FrozenList, yaml.representer.SafeRepresenter.represent_list)
