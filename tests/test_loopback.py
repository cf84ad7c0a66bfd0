"""Single-node launches listen on loopback only: a running job's listening sockets (its
launcher's rendezvous store, every rank's gloo sockets), listed while it runs, are all on
127.0.0.1, and two concurrent launches get different store ports."""
from __future__ import annotations

import ast
import ipaddress
import os
import re
import threading
import time

import psutil
import pytest

from conftest import REPO, resolve


def listening_addresses(identity_key: str) -> dict[int, list[str]]:
    """{pid: [ip:port, ...]} of every listening TCP socket of the launch's processes."""
    from distlab.launchers.process import processes_of

    found = {}
    for proc in processes_of(identity_key):
        try:
            found[proc.pid] = [f"{c.laddr.ip}:{c.laddr.port}" for c in proc.net_connections(kind="tcp")
                               if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def launch_and_list(tmp_path, command: list[str], env: dict, ranks: int = 2) -> tuple[dict, list[str]]:
    """Start the launch, wait until every rank is in its process group, list the sockets,
    release the ranks; returns ({pid: addresses}, [store port each rank was given])."""
    from distlab.launchers.process import run_key, run_tree

    marker = str(tmp_path / "job.json")
    status = {}
    thread = threading.Thread(target=lambda: status.update(code=run_tree(command, env, None, 240, marker=marker)))
    thread.start()
    try:
        deadline = time.monotonic() + 200
        while not all((tmp_path / f"ready{r}").exists() for r in range(ranks)):
            assert thread.is_alive() and time.monotonic() < deadline, f"the ranks never got ready ({status})"
            time.sleep(0.2)
        sockets = listening_addresses(run_key(marker))
    finally:
        (tmp_path / "release").write_text("")
        thread.join()
    assert status.get("code") == 0, status
    return sockets, [(tmp_path / f"ready{r}").read_text() for r in range(ranks)]


def assert_loopback_only(sockets: dict[int, list[str]]) -> None:
    addresses = [a for per_process in sockets.values() for a in per_process]
    assert len(addresses) >= 3, sockets  # the launcher's store and at least one gloo socket per rank
    outside = [a for a in addresses if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not outside, f"listening beyond loopback: {outside} (all: {sockets})"


@pytest.fixture
def probe_env():
    return dict(os.environ, PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["module", "script"])
def test_a_torchrun_launch_listens_on_loopback_only(tmp_path, probe_env, target):
    """Training's ranks (a module) and the benchmarks' and tests' own rank scripts alike."""
    from distlab.launchers import loopback
    from distlab.launchers.torchrun import torchrun_command, torchrun_script_command

    command = (torchrun_command(2, "loopback_probe", str(tmp_path)) if target == "module" else
               torchrun_script_command(2, REPO / "tests" / "loopback_probe.py", str(tmp_path)))
    sockets, ports = launch_and_list(tmp_path, command, {**probe_env, **loopback.environment()})
    assert_loopback_only(sockets)
    assert ports[0] == ports[1] and int(ports[0]) > 0  # port 0 became the port the OS picked


@pytest.mark.slow
def test_an_accelerate_launch_listens_on_loopback_only(tmp_path, probe_env):
    from distlab.launchers.accelerate import accelerate_command, launch_environment, write_accelerate_config

    spec = resolve({"world_size": 2}, stage="accelerate")
    config = write_accelerate_config(spec, tmp_path, str(tmp_path / "job.json"))
    command = accelerate_command(str(config), "loopback_probe", "--job", "unused")
    command[command.index("--job") + 1] = str(tmp_path)  # the probe reads its folder from the last argument
    env = {**launch_environment(spec), "PYTHONPATH": probe_env["PYTHONPATH"]}
    sockets, _ = launch_and_list(tmp_path, command, env)
    assert_loopback_only(sockets)


# A torchrun started any other way: its rendezvous store listens on every interface, and the
# c10d backend keeps pickled state in it.
PLAIN_TORCHRUN = re.compile(r"-m torch\.distributed\.run|\btorchrun --|--rdzv-backend[= ]c10d|--rdzv-endpoint")
# The one place that builds single-node torchrun commands (and the module that says why), and
# the per-host agents of a link (each in its own network namespace, on the link's private address).
TORCHRUN_BUILDERS = {"distlab/launchers/torchrun.py", "distlab/launchers/loopback.py", "distlab/launchers/linked.py"}
CODE_FOLDERS = ("distlab", "benchmarks", "scripts", "tests")


def test_no_code_of_the_repository_starts_torchrun_beside_the_loopback_launch():
    """The benchmarks' bare and Trainer loops and test_fsdp's ranks went through a plain
    `torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0`: every interface, pickled state."""
    offenders = []
    for path in sorted(p for folder in CODE_FOLDERS for p in (REPO / folder).rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative in TORCHRUN_BUILDERS or relative == "tests/test_loopback.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == "torch.distributed.run" or PLAIN_TORCHRUN.search(node.value)):
                offenders.append(f"{relative}:{node.lineno}: {node.value[:80]!r}")
    assert not offenders, offenders
