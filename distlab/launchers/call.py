"""One distlab function in a process of its own: `python -m distlab.launchers.call <module>:<function>
<keyword arguments as JSON>`, started by `call_in_own_process` from a rule's script.

Why: a rule whose work imports torch and transformers (the compute probe, the base model's
evaluation) paid ~5-7 s of imports in its script's fresh interpreter, more than its work takes
on the default model. As a process distlab starts, it forks from the run's warm-start server on
CPU, as ranks do (distlab.launchers.warm_start), and it gets the same process handling: it dies
with the job, and its whole tree is killed on an error or a signal (distlab.launchers.process).
"""
from __future__ import annotations

import importlib
import json
import os
import sys

from distlab.launchers.entry import entry_command


def call_in_own_process(target: str, marker: str, device: str = "cpu", **kwargs) -> None:
    """Run distlab function `target` ("distlab.<module>:<function>") with `kwargs` (JSON values)
    in a process of its own and wait for it; its output goes to this process's (the rule's log).
    marker: the file it writes, whose path names its processes (distlab.launchers.process).
    device "cpu": no GPU visible, and a warm start where the run offers one; "cuda": the job's
    GPUs, and a fresh start, as a GPU rank's."""
    from distlab.launchers.environment import BASE_ENV, CPU_ENV
    from distlab.launchers.process import run_ranks
    from distlab.launchers.warm_start import SOCKET_ENV

    _split(target)  # a bad target fails here, in the rule's own process
    env = {**os.environ, **BASE_ENV}
    if device == "cpu":
        env.update(CPU_ENV)
    else:
        env.pop(SOCKET_ENV, None)
    command = entry_command("distlab.launchers.call", target, json.dumps(kwargs))
    run_ranks(command, env, None, None, marker=os.path.abspath(marker), what=target)


def _split(target: str) -> tuple[str, str]:
    module, _, name = target.partition(":")
    if not module.startswith("distlab.") or not name.isidentifier():
        raise ValueError(f"{target!r}: a call names a distlab function as distlab.<module>:<function>")
    return module, name


def main(argv: list[str]) -> None:
    target, kwargs = argv
    module, name = _split(target)
    getattr(importlib.import_module(module), name)(**json.loads(kwargs))


if __name__ == "__main__":
    main(sys.argv[1:])
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()
