"""A link launch with the run's warm-start server offered (distlab/launchers/links.py,
distlab.launchers.warm_start): its ranks must sit in their host namespaces, as without a server.
A copy forked by the server would run in the server's (this machine's) network namespace, where
10.77.0.1 is unreachable: its store client retried for gloo's 30 minutes.

Needs root (namespaces, veth, tc); elsewhere the module is skipped with the reason the config
check would give."""
import json

import pytest

from conftest import resolve, run_experiment
from warm_fixtures import server, server_log  # noqa: F401 - server: a fixture

from distlab.launchers import links
from distlab.launchers import warm_start

pytestmark = pytest.mark.skipif(bool(links.refusal()), reason=f"links cannot be made here: {links.refusal()}")


@pytest.mark.slow
def test_a_link_launch_with_a_warm_server_offered_runs_its_ranks_in_their_host_namespaces(server, prepared,
                                                                                          tmp_path, monkeypatch):
    monkeypatch.setenv(warm_start.SOCKET_ENV, server)
    spec = resolve({"world_size": 2, "link": {"bandwidth_mbit": 200}}, steps=3, untimed_steps=1)
    run = run_experiment(prepared, tmp_path / "run", spec, checkpoint=False)
    link = json.loads((tmp_path / "run" / "run_files" / "link.json").read_text())
    # Never offered the server (not refused by it either): a fresh interpreter in the host.
    assert run["timeline"]["start"] == "fresh interpreter"
    assert "refused" not in server_log(server)
    # Each rank's gradients crossed its host's eth0: the ranks were inside the hosts.
    grad_bytes = 4 * run["parameters"]["trainable"]
    for host in link["per_host"]:
        assert host["tx_bytes"] >= 3 * grad_bytes, (host, grad_bytes)
