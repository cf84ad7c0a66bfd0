"""Lazy registries (strategies, launchers): a name maps to "module:attribute", imported only
when a run asks for it, so parsing the Snakefile never imports torch or Ray."""
from __future__ import annotations

import importlib


def load(registry: dict[str, str], name: str, kind: str):
    """The attribute `name` stands for; NotImplementedError naming the choices when there is none."""
    try:
        target = registry[name]
    except KeyError:
        raise NotImplementedError(
            f"{kind} '{name}' is not implemented in this version of distlab (available: {sorted(registry)})"
        ) from None
    module, attribute = target.split(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # a missing dependency, not a missing module of distlab
        raise NotImplementedError(f"{kind} '{name}' is not implemented in this version of distlab") from None
