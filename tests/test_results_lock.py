"""One workflow at a time per results folder: a second run (another clone, --nolock, another
host on one shared folder) is refused when its Snakefile loads, before Snakemake can delete
anything of the first run, and names the holder."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, tiny_config
from distlab.configuration.results_lock import LOCK_NAME, ResultsFolderBusy, acquire, is_read_only_call
from distlab.records.run_outputs import read_run_record

HOLD = ("import sys, time; sys.path.insert(0, sys.argv[2]); from distlab.configuration.results_lock import acquire; "
        "acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)")


def hold_in_subprocess(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(REPO)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_its_lock_left_alone(tmp_path):
    holder = hold_in_subprocess(tmp_path)
    try:
        before = (tmp_path / LOCK_NAME).read_text()
        with pytest.raises(ResultsFolderBusy) as refused:
            acquire(tmp_path)
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and socket.gethostname() in message and "started 20" in message
        assert f"delete {tmp_path / LOCK_NAME}" in message  # the documented way out of a stale one
        assert (tmp_path / LOCK_NAME).read_text() == before
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_whose_holder_died_is_replaced_and_released_at_exit(tmp_path):
    holder = hold_in_subprocess(tmp_path)
    holder.send_signal(signal.SIGKILL)  # no chance to clean up
    holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid
    lock = acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_of_two_workflows_that_find_the_same_stale_lock_only_one_takes_the_folder(tmp_path, monkeypatch):
    """B opened the stale lock file before A replaced it; A took the folder and holds it. When
    B then gets the stale file's flock (A let go of it), B must judge the file the name now
    names, A's, and stop: not replace A's live lock with its own."""
    import distlab.configuration.results_lock as results_lock

    dead = hold_in_subprocess(tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    path = tmp_path / LOCK_NAME
    opened_before = os.open(path, os.O_RDONLY)  # B's view of the lock, taken before A's replace
    winner = hold_in_subprocess(tmp_path)  # A: replaces the stale lock and holds the folder
    try:
        assert json.loads(path.read_text())["pid"] == winner.pid
        real_open, handed = os.open, []

        def open_as_before(name, flags, *args):
            if str(name) == str(path) and flags == os.O_RDONLY and not handed:
                handed.append(name)
                return opened_before
            return real_open(name, flags, *args)

        monkeypatch.setattr(results_lock.os, "open", open_as_before)
        with pytest.raises(ResultsFolderBusy, match=f"pid {winner.pid}"):
            acquire(tmp_path)
        assert handed and json.loads(path.read_text())["pid"] == winner.pid
    finally:
        winner.kill()
        winner.wait()


def test_a_relative_results_dir_s_lock_is_removed_after_the_working_directory_changed(tmp_path, monkeypatch):
    """snakemake -d: the Snakefile takes the lock of a relative results_dir, then the working
    directory changes before the exit hook releases it."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    lock = acquire("results")
    assert (tmp_path / "work" / "results" / LOCK_NAME).is_file()
    monkeypatch.chdir(tmp_path)
    lock.release()
    assert not (tmp_path / "work" / "results" / LOCK_NAME).exists()


@pytest.mark.parametrize("argv, read_only", [
    (["snakemake", "-n"], True), (["snakemake", "-np", "--cores", "2"], True), (["snakemake", "--lint"], True),
    (["/x/snakemake/__main__.py", "--dry-run", "-d", "w"], True), (["snakemake", "--cores", "all"], False),
    (["snakemake", "-d", "/tmp/nl", "--cores", "1"], False), (["snakemake", "--cores", "1", "--nolock"], False),
    (["pytest", "-n", "2"], False),  # not snakemake's command line: take the lock
])
def test_only_calls_that_run_no_job_go_without_the_lock(argv, read_only):
    assert is_read_only_call(argv) is read_only


@pytest.mark.slow
def test_a_second_snakemake_on_the_same_results_folder_is_refused_and_the_first_finishes(prepared, tmp_path):
    """Two real Snakemake processes, two working directories (two clones), one absolute
    results_dir; the second even with --nolock. Today's code let the second delete the first
    run's declared outputs, and the first then failed with nothing to resume from."""
    from report_fixtures import MACHINE, seed_prepared

    first, second = tmp_path / "clone-a", tmp_path / "clone-b"
    seed_prepared(prepared, first)
    second.mkdir()
    cfg = tiny_config({"ddp": {"experiments": [{"world_size": 1}]}}, machine=MACHINE,
                      results_dir=str(first / "results"))
    cfg["defaults"].update(steps=4, untimed_steps=1)
    import yaml

    env = dict(os.environ, PYTHONPATH=str(REPO))
    target = f"{first}/results/{MACHINE}/ddp-full-w1-mb4-ga1/metrics.json"
    commands = []
    for work in (first, second):
        (work / "c.yaml").write_text(yaml.safe_dump(cfg))
        commands.append([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
                         "--configfile", str(work / "c.yaml"), "--cores", "1", target])
    run_a = subprocess.Popen(commands[0], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        lock = first / "results" / LOCK_NAME
        while not (first / "results" / MACHINE / "ddp-full-w1-mb4-ga1" / "job.json").exists():
            assert run_a.poll() is None and time.monotonic() < deadline, run_a.communicate()[0][-3000:]
            time.sleep(0.2)
        run_b = subprocess.run(commands[1] + ["--nolock"], env=env, capture_output=True, text=True, timeout=300)
        out_a = run_a.communicate(timeout=600)[0]
    finally:
        run_a.kill()
    assert run_b.returncode != 0
    assert f"pid {run_a.pid}" in run_b.stdout + run_b.stderr and "in use by another distlab workflow" in \
        run_b.stdout + run_b.stderr
    assert run_a.returncode == 0, out_a[-4000:]  # nothing of the first run was deleted under it
    run = first / "results" / MACHINE / "ddp-full-w1-mb4-ga1"
    assert read_run_record(run / "metrics.json").to_dict()["status"] == "ok"
    assert (run / "checkpoint" / "final").is_dir() and (run / "job.json").is_file()
    assert not lock.exists()  # released when the first run ended
    assert not (second / "results").exists()
