"""Shared fixtures: a tiny prepared workspace (tokenizer, data, model, hardware.json) built
once per test session with distlab.testing (the harness tests and benchmarks share, whose
names are re-exported here), and helpers that run the workflow."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The harness lives in the package (benchmarks share it); re-exported for the test modules.
from distlab.testing import TINY_MODEL, build_prepared, resolve, run_experiment, tiny_config  # noqa: E402,F401
from xdist_schedule import Recorder, group_of, order_groups, read_durations  # noqa: E402

# The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup`, .ci/run): a serial
# run keeps about 1.3 of 2 cores busy (process start, Ray waiting on nodes). Each module is one
# group, so its module-scoped runs happen once; the modules that read the session's finished
# workflow run share a group (one worker builds it). Only test_ray.py starts Ray clusters.
SHARED_GROUPS = {"pipeline": {"test_pipeline", "test_report", "test_bad_input", "test_browser", "test_merge"}}


# Modules whose processes alone take a large part of a 24 GiB machine: the 309M model's full
# fine-tuning (two DDP ranks of ~6 GiB each) and the Ray clusters (a head, nodes, workers). Run
# side by side on the two workers they ran a rank out of memory (the kernel's OOM killer, seen
# 2026-12-07), so each takes one lock shared by the workers; the schedule puts a light group
# after each of them (xdist_schedule.order_groups) so that the other worker runs it meanwhile.
MEMORY_HEAVY = {"test_memory_sharded", "test_ray", "test_two_hosts"}


@pytest.fixture(scope="module", autouse=True)
def one_memory_heavy_module_at_a_time(request, tmp_path_factory):
    if request.module.__name__.rsplit(".", 1)[-1] not in MEMORY_HEAVY:
        yield
        return
    import fcntl

    # The run's temporary root (pytest-<N>/ under xdist, whose workers each have a folder in it).
    with open(tmp_path_factory.getbasetemp().parent / "distlab-memory-heavy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the module fails
        yield


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write each xdist group's seconds into tests/durations.json (tests/xdist_schedule.py)")


def pytest_configure(config):
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):  # xdist's controller
        config.pluginmanager.register(Recorder(SHARED_GROUPS), "distlab-record-durations")


# tryfirst: xdist's own collection hook turns the xdist_group marker into the scheduling key,
# so the markers must be on the items before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    groups, slow_tests = {}, {}
    for item in items:
        group = group_of(item.module.__name__.rsplit(".", 1)[-1], SHARED_GROUPS)
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
        slow_tests[group] = slow_tests.get(group, 0) + bool(item.get_closest_marker("slow"))
    order = order_groups(list(slow_tests), read_durations(), MEMORY_HEAVY, slow_tests)
    rank = {group: position for position, group in enumerate(order)}
    # Stable: the tests of one module keep their order.
    items.sort(key=lambda item: rank[groups[item.nodeid]])


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """tokenizer + data (seq 32) + tiny model + hardware.json, built with the pipeline's own code."""
    return build_prepared(tmp_path_factory.mktemp("prepared"))


def seed_hardware(prepared: Path, workdir: Path, machine: str) -> None:
    """The session's hardware.json as the workflow's in `workdir`: its rule (a probe and a ~5 s
    matmul peak on every core) does not run again."""
    import shutil

    (workdir / "results" / machine).mkdir(parents=True, exist_ok=True)
    shutil.copy(prepared / "hardware.json", workdir / "results" / machine / "hardware.json")


def snakemake(workdir: Path, *args: str, config: dict | None = None, check: bool = True, timeout: int = 900,
              python_path: str | None = None):
    """Run the real workflow in `workdir` (its own results/), optionally with a config file;
    python_path: a folder searched before the repository (a sitecustomize.py, say)."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir)]
    if config is not None:
        path = workdir / "test-config.yaml"
        import yaml

        path.write_text(yaml.safe_dump(config))
        cmd += ["--configfile", str(path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [python_path, str(REPO)])))
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def assert_advisor_estimate_holds(prepared: Path, run: dict, name: str) -> None:
    """The advisor's estimate for a real run's own spec vs the state its rank measured from its
    tensors (distlab.records.metrics / strategies.deepspeed_state), within advisor_check.TOLERANCE. Checked
    on the runs the strategy tests already made, so it costs no run of its own."""
    from distlab.tools import advisor, advisor_check

    shape = advisor.model_shape(json.loads((prepared / "model" / "config.json").read_text()))
    runs = [dict(run, machine="testbox", experiment=name)]
    (row,) = advisor_check.check_against_runs({"model": {"shape": shape}}, runs)
    assert abs(row["measured/estimated"] - 1) <= advisor_check.TOLERANCE, row
    assert row["verdict"] == "right" and not row["where"], row


def load_filed(run_dir, scratch):
    """collect.load_run of a test's run folder, copied under <scratch>/<machine>/<experiment> as a
    results folder files it (load_run refuses a run outside its own machine and experiment folders)."""
    import shutil

    from distlab.report.collect import load_run
    from distlab.records.run_outputs import read_run_record

    record = read_run_record(Path(run_dir) / "metrics.json")
    dest = Path(scratch) / record.machine / record.experiment
    shutil.copytree(run_dir, dest, dirs_exist_ok=True)
    return load_run(dest / "metrics.json")
