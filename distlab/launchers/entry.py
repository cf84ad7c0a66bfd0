"""How distlab starts every process of its own that a warm start may fork: `python -m
distlab.launchers.entry <module> <its arguments>`, built in one place (`entry_command`, or
`entry_target` where torchrun or accelerate launch runs the `-m` itself).

Before the module's heavy imports it runs the start-up every such process needs
(distlab.launchers.process.enter): the parent check (the process dies with its launcher) and,
where the run offers one, a warm start (distlab.launchers.warm_start: this process then ends with
its forked copy, which runs the module itself). Otherwise it runs the module as `python -m` would.
So the entry modules (warm_checks.ENTRY_MODULES, each with its start-up options) carry no
start-up block of their own, and a new one is a line in that table.
"""
from __future__ import annotations

import sys

ENTRY = "distlab.launchers.entry"


def entry_target(module: str, *args: str) -> list[str]:
    """`-m distlab.launchers.entry <module> <args>`: the module form a launcher (torchrun,
    accelerate launch) runs in each of its ranks. A module that is not an entry module (a test's
    or a benchmark's own ranks) runs as `-m <module>`, with no start-up of distlab's."""
    from distlab.launchers.warm_checks import ENTRY_MODULES

    return ["-m", ENTRY, module, *args] if module in ENTRY_MODULES else ["-m", module, *args]


def entry_command(module: str, *args: str) -> list[str]:
    """The whole command of a process distlab starts itself (a launcher agent, a called function)."""
    return [sys.executable, *entry_target(module, *args)]


def main() -> None:
    import runpy

    from distlab.launchers.process import enter
    from distlab.launchers.warm_checks import ENTRY_MODULES

    module = sys.argv[1] if len(sys.argv) > 1 else None
    if module not in ENTRY_MODULES:
        raise SystemExit(f"distlab.launchers.entry: {module!r} is not an entry module "
                         f"(distlab.launchers.warm_checks.ENTRY_MODULES: {', '.join(ENTRY_MODULES)})")
    sys.argv = [module, *sys.argv[2:]]  # the module's own arguments, as `python -m <module>` gives them
    enter(module, **ENTRY_MODULES[module])
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
