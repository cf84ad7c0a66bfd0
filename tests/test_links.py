"""Links you can set: ranks in network namespaces joined by tbf-capped veth pairs (distlab/launchers/links.py).

Needs root (namespaces, veth, tc); elsewhere the module is skipped with the reason the
config check would give.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, resolve, run_experiment

from distlab.configuration import netns
from distlab.launchers import links

pytestmark = pytest.mark.skipif(bool(links.refusal()), reason=f"links cannot be made here: {links.refusal()}")

CAPS = (20, 200)  # Mbit/s
STEPS = 6


@pytest.fixture(scope="module")
def capped_runs(prepared, tmp_path_factory):
    """The same 2-rank DDP run of the tiny model over three links, one after the other."""
    root = tmp_path_factory.mktemp("links")
    runs = {}
    for cap in CAPS:
        spec = resolve({"world_size": 2, "link": {"bandwidth_mbit": cap}}, steps=STEPS, untimed_steps=2)
        run_dir = root / spec["id"]
        runs[cap] = (run_experiment(prepared, run_dir, spec, checkpoint=False),
                     json.loads((run_dir / "run_files" / "link.json").read_text()))
    return runs


def comm(run) -> float:
    return run["timing"]["comm_inflight_s_per_step"]["median"]


@pytest.mark.slow
def test_a_capped_link_slows_ddp_communication_in_the_order_of_its_bandwidth(capped_runs):
    slow, fast = (capped_runs[cap][0] for cap in CAPS)
    assert [r["experiment"] for r in (slow, fast)] == ["ddp-full-w2-mb4-ga1-link20m", "ddp-full-w2-mb4-ga1-link200m"]
    # 10x less bandwidth: the all-reduce takes several times longer (10x when bandwidth-bound).
    assert comm(slow) > 3 * comm(fast), (comm(slow), comm(fast))
    # The link changes the time, never the training: the same losses over both links.
    assert max(abs(a - b) for a, b in zip(slow["loss"]["per_step"], fast["loss"]["per_step"])) < 1e-6


@pytest.mark.slow
def test_the_gradients_crossed_the_capped_link_no_faster_than_its_cap(capped_runs):
    run, link = capped_runs[20]
    assert link["bandwidth_mbit"] == 20 and link["addresses"] == ["10.77.0.1", "10.77.0.2"]
    assert all("tbf" in q and "rate 20Mbit" in q for q in link["qdisc"]), link["qdisc"]
    grad_bytes = 4 * run["parameters"]["trainable"]
    for host in link["per_host"]:
        # A 2-rank ring all-reduce sends each rank's whole gradient once per step (two halves).
        assert host["tx_bytes"] >= STEPS * grad_bytes, (host, grad_bytes)
    # Physics: those bytes cannot cross 20 Mbit/s faster than bytes*8/20e6 seconds.
    assert comm(run) >= 0.8 * grad_bytes * 8 / 20e6, (comm(run), grad_bytes)


@pytest.mark.slow
def test_no_namespace_or_process_of_a_finished_run_is_left(capped_runs):
    mine = links._owner_tag(os.getpid())
    assert [pid for pid, owner in links.tagged_processes() if owner == mine] == []


def running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


KILLED_OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from distlab.launchers.links import LinkedHosts, netns_id
    hosts = LinkedHosts(2, 100).__enter__()
    # A process inside that does not ask to die with its parent (as a Ray daemon may not).
    orphan = subprocess.Popen(hosts.inside(1, ["sleep", "600"]), start_new_session=True)
    time.sleep(0.5)
    print(orphan.pid, netns_id(orphan.pid), *(p.pid for p in hosts.holders.values()), flush=True)
    time.sleep(600)
""")


def test_a_killed_run_leaves_no_namespace_once_the_next_link_sweeps(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        orphan, namespace, *holders = owner.stdout.readline().split()
    finally:
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
    time.sleep(0.5)
    assert not [h for h in holders if running(int(h))]  # holders died with their owner
    assert links.processes_in(namespace) == [int(orphan)]  # the orphan keeps its namespace alive...
    assert int(orphan) in links.sweep_leftovers()  # ...until the sweep every new link starts with
    deadline = time.time() + 10
    while links.processes_in(namespace) and time.time() < deadline:
        time.sleep(0.1)
    assert links.processes_in(namespace) == []  # no process left: the kernel removed the namespace


def test_links_are_refused_at_config_time_naming_why(monkeypatch):
    from distlab.configuration.input_checks import ConfigError

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in netns.refusal.__wrapped__()
    monkeypatch.setattr(netns, "refusal", lambda: "making network namespaces needs root (test)")
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.link': network namespaces cannot be made here: "
                                          r"making network namespaces needs root"):
        resolve({"world_size": 2, "link": {"bandwidth_mbit": 100}})


def test_the_links_target_is_refused_before_any_job_where_namespaces_cannot_be_made(tmp_path):
    """As a non-root user (os.geteuid patched in every process via sitecustomize): the default
    run still plans, `snakemake links` stops before any job, naming the experiment and why."""
    from conftest import snakemake, tiny_config

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import os\nos.geteuid = lambda: 1000\n")
    config = tiny_config({"ddp": {"experiments": [{"world_size": 1}]},
                          "links": {"link_caps_mbit": [100], "experiments": [{"world_size": 2}]}})
    snakemake(tmp_path, "-n", config=config, python_path=str(hook))  # the default target needs no namespace
    refused = snakemake(tmp_path, "-n", "links", config=config, check=False, python_path=str(hook))
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "`snakemake links` cannot run on this machine:" in said
    assert ("experiment ddp-full-w2-mb4-ga1-link100m, field 'link': network namespaces cannot be made here: "
            "making network namespaces, veth pairs and tc qdiscs needs root") in said
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").glob("*/*/metrics.json"))
