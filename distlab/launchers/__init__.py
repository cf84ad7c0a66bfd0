"""Launcher registry: name -> "module:function", imported only when a run asks for it.

Each launcher is `run(job, job_path, log_path, timeout)`: it starts the experiment's ranks
and returns when they have finished (raising when they failed). Process handling lives in
distlab.launchers.process, the rank environment in distlab.launchers.environment.
"""
from __future__ import annotations

from distlab.registry import load

REGISTRY = {
    "torchrun": "distlab.launchers.torchrun:run",
    "accelerate": "distlab.launchers.accelerate:run",
    "ray": "distlab.launchers.ray_driver:run",
}


def get_launcher(name: str):
    return load(REGISTRY, name, "launcher")
