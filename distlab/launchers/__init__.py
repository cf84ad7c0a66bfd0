"""Launcher registry: name -> "module:function", imported only when a run asks for it. The
names a config may use are declared a layer down (distlab.configuration.axes.LAUNCHERS, with
RANK_LIBRARIES): the config is checked without this package.

Each launcher is `run(job, job_path, log_path, timeout)`: it starts the experiment's ranks
and returns when they have finished (raising when they failed). Ranks on this machine start
through distlab.launchers.ranks (also validation's and the collective benchmark's); process
handling lives in distlab.launchers.process, the rank environment in distlab.launchers.environment,
hosts joined by a link (network namespaces) in distlab.launchers.links.
"""
from __future__ import annotations

from distlab.registry import load

REGISTRY = {
    "torchrun": "distlab.launchers.ranks:run",  # one service for both (and validation, collectives)
    "accelerate": "distlab.launchers.ranks:run",
    "ray": "distlab.launchers.ray_driver:run",
}


def get_launcher(name: str):
    return load(REGISTRY, name, "launcher")
