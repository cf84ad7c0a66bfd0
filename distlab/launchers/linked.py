"""torchrun over a link: each rank in its own network namespace (distlab/launchers/links.py).

An experiment with `link:` runs one torchrun agent per host namespace (`--nnodes=N
--nproc-per-node=1 --node-rank=i`), as on N machines. Rendezvous is torchrun's static one:
host 0's agent holds the store at 10.77.0.1:29500. That address is not loopback, on
purpose: the ranks are on different "machines"; and it is reachable only from the run's own
namespaces (each holds `lo` and one veth to the run's bridge, nothing else), so the store
and gloo's sockets, which listen on every address of their namespace, are never reachable
from this machine's own network or beyond. GLOO_SOCKET_IFNAME binds gloo to that veth.

What the link carried is measured, not assumed: the kernel's byte counters of each host's
eth0 before and after the ranks ran go to run_files/link.json with the qdisc the kernel
reports (`tc qdisc show`).
"""
from __future__ import annotations

import json
import sys
import time

from distlab.launchers.entry import entry_target
from distlab.records.job import Job
from distlab.launchers.environment import rank_environment
from distlab.launchers.process import launch_failure, launch_line, run_trees
from distlab.launchers.links import INTERFACE, LinkedHosts
from distlab.records.run_layout import run_files_dir

# Inside a run's own namespaces no other process listens: a fixed port cannot collide.
MASTER_PORT = 29500


def node_command(hosts: LinkedHosts, node_rank: int, module: str, *args: str) -> list[str]:
    """torchrun for one host of the link (one rank on it), started inside that host."""
    return hosts.inside(node_rank, [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts.n_hosts}", "--nproc-per-node=1",
        f"--node-rank={node_rank}", "--rdzv-backend=static", f"--master-addr={hosts.address(0)}",
        f"--master-port={MASTER_PORT}", "--max-restarts=0", *entry_target(module, *args)])


def link_environment(env: dict) -> dict:
    """gloo (and torchrun's store client) over the host's link interface only."""
    return dict(env, GLOO_SOCKET_IFNAME=INTERFACE)


def run_on_link(hosts: LinkedHosts, module: str, args: list[str], env: dict, log_path: str | None,
                timeout: float | None, marker: str | None = None) -> dict:
    """Run `module` with one rank per host; returns the link record (bytes each host sent
    and received while it ran). Raises like run_ranks when a rank fails or times out."""
    commands = [node_command(hosts, i, module, *args) for i in range(hosts.n_hosts)]
    before = hosts.counters()
    started = time.perf_counter()
    log = open(log_path, "a") if log_path else None
    try:
        print("".join(launch_line(cmd) for cmd in commands), end="", file=log or sys.stdout, flush=True)
        status = run_trees(commands, link_environment(env), log, timeout, marker)
    finally:
        if log:
            log.close()
    if status != 0:
        raise launch_failure(status, timeout, log_path)
    after = hosts.counters()
    moved = [{key: a[key] - b[key] if isinstance(a[key], int) and key != "host" else a[key] for key in a}
             for a, b in zip(after, before)]
    return {**hosts.describe(), "seconds": time.perf_counter() - started, "per_host": moved,
            "counters_how": "the kernel's counters of each host's eth0 (/proc/<pid>/net/dev of its namespace), "
                            "after minus before the launch: every byte a rank sent or received, headers included"}


def run(job: Job, job_path: str, log_path: str | None, timeout: float | None) -> None:
    spec = job.spec
    with LinkedHosts(spec.world_size, spec.link["bandwidth_mbit"]) as hosts:
        record = run_on_link(hosts, "distlab.rank.worker", ["--job", job_path], rank_environment(spec), log_path,
                             timeout, marker=job_path)
    (run_files_dir(job.run_dir) / "link.json").write_text(json.dumps(record, indent=1))
