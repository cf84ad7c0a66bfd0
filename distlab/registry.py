"""Lazy registries (strategies, tasks, launchers): a name maps to "module:attribute", imported
only when a run asks for it, so parsing the Snakefile never imports torch or Ray; and the
discovery of declarations by their files (a strategy's settings, a task's declaration)."""
from __future__ import annotations

import importlib
import pkgutil


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


def discover(package: str, path: tuple[str, ...], attribute: str, suffix: str = "", skip: tuple = ()) -> dict:
    """{name: the module's `attribute`} of every module of `package` (found on `path`: its search
    path, which a test may extend) whose name ends in `suffix` and that holds `attribute`, in
    module-name order; each one's `.name` is its file's name (with "-" for "_"), so a declaration
    is found by its file alone."""
    found = {}
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in skip or not info.name.endswith(suffix):
            continue
        declared = getattr(importlib.import_module(f"{package}.{info.name}"), attribute, None)
        if declared is None:
            continue
        stem = info.name[:len(info.name) - len(suffix)]
        if declared.name.replace("-", "_") != stem:
            raise ValueError(f"{package.replace('.', '/')}/{info.name}: {attribute}.name is '{declared.name}', "
                             f"its file names '{stem.replace('_', '-')}'")
        found[declared.name] = declared
    return found
