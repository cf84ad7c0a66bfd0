"""A Ray cluster of real `ray start` nodes on this machine: on 127.0.0.1 (tests/test_ray.py), or
each node on a host of its own, in a network namespace of a link (distlab/launchers/links.py: the
two-host run, `snakemake two_hosts`).

Every node is a `ray start --block` in its own session, stopped by signalling that process
(it takes its Ray children down with it), never `ray stop`: that stops every Ray process of
the machine, other people's jobs included. Token auth is on, with the token in the cluster's
own temp folder (not $HOME): what a fresh CI box needs.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
# Inside a link's namespaces nothing else listens: Ray's default GCS port cannot collide.
NAMESPACED_PORT = 6379


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def token_auth_environment(folder: str) -> dict:
    """Ray token auth for the processes of a cluster distlab starts: a new token (256 random
    bits, what `ray get-auth-token --generate` writes) in `folder`, readable by its owner only.
    RAY_AUTH_MODE=token is set, never left to Ray: `ray start --head` turns auth on by itself
    only when a token file already exists, and `ray start --address` or a driver given an
    address never does (Ray 2.60, ray/scripts/scripts.py, ray/_private/worker.py); only a
    local ray.init() of a new cluster does. docs/ray.md's two-machine steps set the same keys."""
    token = Path(folder, "auth_token")
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}


class RayNodes:
    """A head (and nodes added later). hosts: a LinkedHosts whose host 0 runs the head and
    whose other hosts run the nodes added with `host=`; None: every node on 127.0.0.1."""

    def __init__(self, head_cpus: int, hosts=None):
        self.hosts = hosts
        self.folder = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: unix socket paths
        self.env = {**token_auth_environment(self.folder), "RAY_USAGE_STATS_ENABLED": "0"}
        self.port = NAMESPACED_PORT if hosts else free_port()
        self.head_ip = hosts.address(0) if hosts else "127.0.0.1"
        self.address = f"{self.head_ip}:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.node_hosts: dict[str, int] = {}
        try:
            self._start("head", ["--head", f"--port={self.port}", "--include-dashboard=false", "--disable-usage-stats",
                                 f"--temp-dir={self.folder}"], head_cpus, host=0)
            self._wait_for_head()
        except BaseException:
            self.shutdown()
            raise

    def inside(self, host: int | None, command: list[str]) -> list[str]:
        return self.hosts.inside(host, command) if self.hosts is not None and host is not None else command

    def _start(self, name: str, args: list[str], cpus: int, host: int = 0) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
        env.update(self.env)
        ip = self.hosts.address(host) if self.hosts else "127.0.0.1"
        parent = os.getpid()
        from distlab.launchers.process import die_with_parent

        with open(Path(self.folder, f"{name}.log"), "w") as log:
            # The node dies with whoever started it (Ray's own daemons share the fate of `ray start`).
            self.nodes[name] = subprocess.Popen(
                self.inside(host, RAY + ["start", "--block", f"--node-ip-address={ip}", f"--num-cpus={cpus}", *args]),
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent))
        self.node_hosts[name] = host

    def _head_reachable(self) -> bool:
        if self.hosts is None:
            with socket.socket() as sock:
                return sock.connect_ex((self.head_ip, self.port)) == 0
        probe = f"import socket; socket.create_connection(({self.head_ip!r}, {self.port}), 1)"
        return subprocess.run(self.inside(0, [sys.executable, "-c", probe]), capture_output=True).returncode == 0

    def _wait_for_head(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.nodes["head"].poll() is not None:
                raise RuntimeError(f"ray head exited: {Path(self.folder, 'head.log').read_text()[-3000:]}")
            if self._head_reachable():
                return
            time.sleep(0.5)
        raise TimeoutError("ray head did not open its port")

    def add_node(self, name: str, cpus: int = 1, host: int = 0) -> None:
        """Another node joining the head (host: which host of the link it runs on)."""
        self._start(name, [f"--address={self.address}"], cpus, host=host)

    def stop_node(self, name: str, grace: float = 10) -> None:
        """SIGTERM (Ray drains the node), then SIGKILL whatever of its tree is left."""
        proc = self.nodes[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.crash_node(name)

    def crash_node(self, name: str) -> None:
        """SIGKILL a node's `ray start` and every process under it (raylet, its workers): a
        machine that drops off, not one that drains politely."""
        import psutil

        proc = self.nodes.pop(name)
        self.node_hosts.pop(name, None)
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = [psutil.Process(proc.pid)]
            tree += tree[0].children(recursive=True)
            for member in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
        proc.wait(30)

    def shutdown(self) -> None:
        for proc in self.nodes.values():  # all at once: each takes seconds to wind down
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in [n for n in self.nodes if n != "head"] + [n for n in self.nodes if n == "head"]:
            self.stop_node(name)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "RayNodes":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
