"""What a warm-start server checks before it forks, what the stop hooks may remove, and the
command line's switch (distlab.launchers.warm_checks, distlab.launchers.warm_start): no server
needed, each in well under a second but for the processes it starts in another context."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from distlab.launchers import warm_checks, warm_start

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and cgroups are made as root")


@pytest.fixture
def server_context(monkeypatch):
    """warm_checks' record of a server started as this process."""
    monkeypatch.setattr(warm_checks, "context_before_imports", warm_checks.process_context("self"))


@pytest.fixture
def other_process():
    """Start `command` (a sleep) in a context of its own; killed afterwards."""
    started = []

    def start(*command: str, cgroup: Path | None = None) -> int:
        proc = subprocess.Popen([*command, "sleep", "60"])
        started.append(proc)
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(proc.pid))
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)  # until prlimit / unshare has exec'd the sleep
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_stand_in_in_this_context_may_have_a_copy(server_context, other_process):
    assert warm_checks.context_refusal(other_process()) is None


def test_a_stand_in_with_other_resource_limits_gets_no_copy(server_context, other_process):
    pid = other_process("prlimit", "--nofile=1000:1000", "--")
    assert warm_checks.context_refusal(pid).startswith("limit 'Max open files' differs ('1000 1000 files'")


@needs_root
def test_a_stand_in_in_another_network_namespace_gets_no_copy(server_context, other_process):
    pid = other_process("unshare", "--net", "--")
    assert warm_checks.context_refusal(pid).startswith("net namespace differs ('net:[")


@needs_root
def test_a_stand_in_in_another_cgroup_gets_no_copy(server_context, other_process, tmp_path):
    cgroup = Path("/sys/fs/cgroup/pids") / f"distlab-test-{os.getpid()}"
    try:
        cgroup.mkdir()
    except OSError as error:
        pytest.skip(f"no pids cgroup can be made here: {error}")
    try:
        pid = other_process(cgroup=cgroup)
        assert warm_checks.context_refusal(pid).startswith("cgroup differs (")
        assert f"pids:/{cgroup.name}" in warm_checks.context_refusal(pid)
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                cgroup.rmdir()
                break
            except OSError:  # its sleep is still being killed
                time.sleep(0.05)


def test_a_stand_in_gone_before_its_check_gets_no_copy(server_context):
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert "it is gone" in warm_checks.context_refusal(proc.pid)
    assert "another pid namespace" in warm_checks.context_refusal(0)


@pytest.mark.parametrize("request_, named", [
    ([], "a request is a JSON object, not list"),
    ({"argv": []}, "request field 'module' is missing"),
    ({"module": 3}, "request field 'module' is int, not str"),
    ({"module": "distlab.rank.worker", "argv": "-m"}, "request field 'argv' is str, not list"),
    ({"module": "distlab.rank.worker", "argv": [1]}, "request field 'argv' holds an item that is not str"),
])
def test_a_request_of_the_wrong_shape_is_refused_naming_the_field(request_, named):
    assert warm_checks.shape_error(request_) == named


def test_a_stand_in_that_sets_no_thread_count_gets_a_copy_only_where_the_server_set_none(monkeypatch):
    monkeypatch.setattr(warm_checks, "environ_before_imports", {"OMP_NUM_THREADS": "2"})
    mine = sorted(os.sched_getaffinity(0))
    assert "no MKL_NUM_THREADS/OMP_NUM_THREADS set" in warm_checks.thread_refusal({}, mine)
    assert warm_checks.thread_refusal({"OMP_NUM_THREADS": "1"}, mine) is None
    monkeypatch.setattr(warm_checks, "environ_before_imports", {})
    assert warm_checks.thread_refusal({}, mine) is None
    assert "count the CPUs itself" in warm_checks.thread_refusal({}, mine + [max(mine) + 1])


def test_a_copy_sets_openblas_threads_as_a_fresh_process_reads_them():
    """numpy's OpenBLAS counted its threads when the server imported it; a copy of a rank
    started with OMP_NUM_THREADS=1 runs it on one, as a fresh rank would."""
    import numpy  # noqa: F401 - loads its OpenBLAS, as transformers does in the server
    from threadpoolctl import ThreadpoolController, threadpool_info

    blas = ThreadpoolController().select(internal_api="openblas")
    before = [pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"]
    assert before
    try:
        blas.limit(limits=2)
        warm_checks.apply_thread_settings({"OMP_NUM_THREADS": "1"})
        assert {pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"} == {1}
        warm_checks.apply_thread_settings({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "2"})
        expected = min(2, len(os.sched_getaffinity(0)))
        assert {pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"} == {expected}
    finally:
        for pool, count in zip(ThreadpoolController().select(internal_api="openblas").lib_controllers, before):
            pool.set_num_threads(count)


# -- the stop hooks and stale folders ------------------------------------------------------------------
def foreign_folder(root: Path, name: str = "distlab-warm-notmine") -> Path:
    """A folder named as a server's, holding a socket-named file and a file a server never makes."""
    folder = root / name
    (folder / "copies").mkdir(parents=True)
    (folder / "socket").write_text("")
    (folder / "copies" / "123").write_text("x")
    (folder / "notes.txt").write_text("keep me")
    return folder


def test_the_stop_hooks_remove_nothing_of_a_server_this_run_did_not_start(tmp_path, monkeypatch):
    """A nested run (or any process given a rank's environment) inherits DISTLAB_WARM_SOCKET:
    with warm starts off it neither offers that server to its ranks nor deletes its folder."""
    folder = foreign_folder(tmp_path)
    monkeypatch.setenv(warm_start.SOCKET_ENV, str(folder / "socket"))
    assert warm_start.start_run_server(False, {}, str(tmp_path / "warm-start.log")) is None
    assert warm_start.SOCKET_ENV not in os.environ  # this run's ranks start fresh
    warm_start.stop_run_server()
    assert sorted(p.name for p in folder.rglob("*")) == ["123", "copies", "notes.txt", "socket"]


def test_stopping_a_server_removes_only_the_files_it_made(tmp_path):
    folder = foreign_folder(tmp_path)
    (folder / "flavour-0").write_text("")
    warm_start.stop_server(str(folder / "socket"))
    assert sorted(p.name for p in folder.rglob("*")) == ["notes.txt"]  # the server's files went
    other = foreign_folder(tmp_path, "some-other-folder")
    warm_start.stop_server(str(other / "socket"))  # not a server's folder by name: left alone
    assert sorted(p.name for p in other.rglob("*")) == ["123", "copies", "notes.txt", "socket"]


def test_the_next_start_removes_the_folders_of_dead_servers_only(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, kept, live = (tmp_path / f"distlab-warm-{name}" for name in ("stale", "kept", "live"))
    for folder, pid, started in ((stale, dead.pid, 1.0), (kept, dead.pid, 1.0),
                                 (live, os.getpid(), __import__("psutil").Process().create_time())):
        (folder / "copies").mkdir(parents=True)
        (folder / "socket").write_text("")
        (folder / warm_start.SERVER_RECORD).write_text(f"{pid} {started}")
    (kept / "notes.txt").write_text("keep me")
    assert warm_start.remove_stale_folders(str(tmp_path)) == [str(kept), str(stale)]
    assert not stale.exists()
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in live.iterdir()) == ["copies", warm_start.SERVER_RECORD, "socket"]


# -- the command line's switch ---------------------------------------------------------------------------
@pytest.mark.parametrize("given, meant", [("false", False), ("False", False), ("no", False), ("true", True),
                                          (False, False)])
def test_warm_start_can_be_switched_off_on_the_command_line(given, meant):
    """`snakemake --config warm_start=false` hands the config the string "false"."""
    from conftest import tiny_config
    from distlab.configuration.config import ConfigError, validate_schema

    assert validate_schema({**tiny_config({}), "warm_start": given})["warm_start"] is meant
    with pytest.raises(ConfigError, match="config field 'warm_start'"):
        validate_schema({**tiny_config({}), "warm_start": "maybe"})


def test_the_documented_command_that_switches_warm_starts_off_plans(tmp_path):
    from conftest import snakemake, tiny_config

    planned = snakemake(tmp_path, "-n", "--config", "warm_start=false",
                        config=tiny_config({"ddp": {"experiments": [{"world_size": 1}]}}))
    assert planned.returncode == 0
    docs = (Path(__file__).resolve().parent.parent / "docs" / "warm-start.md").read_text()
    assert "--config warm_start=false" in docs
