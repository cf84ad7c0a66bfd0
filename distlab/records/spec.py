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
"""
from __future__ import annotations

from collections.abc import Mapping

import yaml


def _refuse(self, *args, **kwargs):
    raise TypeError(f"a {type(self).__name__} is frozen: build a new one "
                    "(spec.replace(key=value)) instead of changing it in place")


def freeze(value):
    """Nested dicts and lists as FrozenDict / FrozenList (other values as they are)."""
    if isinstance(value, FrozenDict) or isinstance(value, FrozenList):
        return value
    if isinstance(value, Mapping):
        return FrozenDict(value)
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


# The fields every part of distlab reads without a default: a spec without them (a job file
# edited by hand, one from another version) is refused at the door, naming the field.
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,), "stage": (str,), "task": (str,), "strategy": (str,), "launcher": (str,), "method": (str,),
    "device": (str,), "precision": (str,), "world_size": (int,), "micro_batch": (int,), "grad_accum": (int,),
    "seq_len": (int,), "seed": (int,), "untimed_steps": (int,),
}


class SpecError(ValueError):
    """A spec that lacks a field every reader needs, or holds it with the wrong type."""


class Spec(FrozenDict):
    """One experiment's resolved settings (the schema's experiment keys plus id, stage and the
    resolved launcher and device). Frozen: `replace` returns a new Spec."""
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
    _dumper.add_representer(Spec, yaml.representer.SafeRepresenter.represent_dict)
    _dumper.add_representer(FrozenList, yaml.representer.SafeRepresenter.represent_list)
