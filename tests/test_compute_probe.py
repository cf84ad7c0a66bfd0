"""The compute probe a run's step-time prediction reads: each kernel of its key timed in a
process of its own (distlab.launchers.call), which on CPU forks from the run's warm interpreter as
ranks do. Every kernel is sampled across the whole probe, not in one stretch, so a busy spell of a shared
machine slows all kernels alike; each kernel's time is the median of its calls; the neighbours
run the kernel being timed.
"""
from __future__ import annotations

import json
import mmap
import os
import time

import pytest

from distlab.launchers import warm_start
from distlab.testing import TINY_MODEL
from distlab.tools import compute_probe as P
from distlab.tools.compute_probe import run_probe
from distlab.runtime.parameter_counts import model_shape, parameter_counts
from distlab.tools.step_time import kernels_needed

from warm_fixtures import server  # noqa: F401 - a fixture

KEY = "cpu-float32-t1-r2x32-tp1"


def tiny_config_json(tmp_path):
    config = {"model_type": "llama", "vocab_size": 512, "rms_norm_eps": 1e-6,
              **{k: v for k, v in TINY_MODEL.items() if k != "seed"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return config, path


@pytest.mark.slow
def test_the_probe_times_every_kernel_of_its_key_and_starts_warm_where_a_server_is_offered(server, tmp_path,
                                                                                         monkeypatch):
    config, path = tiny_config_json(tmp_path)
    shape = model_shape(config)
    wanted = {f"{k['key']}|{k['dtype']}|{k['threads']}" for k in kernels_needed(KEY, shape, parameter_counts(shape))}

    run_probe(str(path), KEY, "tiny", str(tmp_path / "fresh.json"))
    monkeypatch.setenv(warm_start.SOCKET_ENV, server)
    run_probe(str(path), KEY, "tiny", str(tmp_path / "warm.json"))

    fresh, warm = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("fresh", "warm"))
    for record in (fresh, warm):
        assert record["key"] == KEY and set(record["kernels"]) == wanted
        assert all(row["s"] > 0 and row["repeats"] >= 3 for row in record["kernels"].values())
    assert fresh["start"] == "fresh interpreter"
    assert warm["start"].startswith("forked from the run's warm interpreter"), warm["start"]


def test_a_call_names_a_distlab_function_before_any_process_starts(tmp_path):
    from distlab.launchers.call import call_in_own_process

    for target in ("os:system", "distlab.tools.compute_probe", "distlab.tools.compute_probe:not a name"):
        with pytest.raises(ValueError, match="distlab.<module>:<function>"):
            call_in_own_process(target, str(tmp_path / "out.json"))


@pytest.fixture
def recorded(monkeypatch):
    """Kernels that record which of them ran, in this process, in call order."""
    order: list[str] = []
    pid = os.getpid()

    def fake_kernel(kind, dims, dtype, device, config_json=None):
        def both():
            if os.getpid() == pid:  # not the forked neighbours' calls
                order.append(kind)
        return None, both

    monkeypatch.setattr(P, "_kernel", fake_kernel)
    return order


def kernel(kind: str) -> dict:
    return {"key": f"{kind}:1", "kind": kind, "dims": [1], "dtype": "float32", "threads": 1}


def test_the_probe_interleaves_its_kernels_in_rounds_so_every_kernel_samples_the_same_spells(recorded):
    found = P.probe([kernel("mm"), kernel("sdpa"), kernel("mm")], "cpu")
    runs = [kind for i, kind in enumerate(recorded) if i == 0 or recorded[i - 1] != kind]
    assert runs == ["mm", "sdpa"] * P.ROUNDS  # one stretch each would be ["mm", "sdpa"]
    assert set(found["kernels"]) == {"mm:1|float32|1", "sdpa:1|float32|1"}  # the repeated kernel timed once
    for row in found["kernels"].values():
        assert len(row["round_s"]) == P.ROUNDS
        assert row["repeats"] >= P.ROUNDS


class QuietWindow:
    """A NoiseProbe window that reads no clock: 1 s, nothing but the probe's own CPU."""

    def start(self):
        pass

    def stop(self):
        return {"wall_s": 1.0, "machine_cpu_s": 0.0, "own_cpu_s": 0.0, "load_avg_1min": [0.0, 0.0]}


def test_a_kernels_time_is_the_median_of_all_its_calls_over_the_rounds(monkeypatch):
    durations = [1.0, 5.0, 2.0, 4.0, 3.0]  # one call a round: each outlasts the round's budget
    ticks = iter([x for d in durations for x in (0.0, d)])  # each call's start, then its end
    clock = {"now": 0.0}

    def fake_counter():
        clock["now"] += next(ticks)
        return clock["now"]

    monkeypatch.setattr(P, "_kernel", lambda *a, **k: (None, lambda: None))
    monkeypatch.setattr(P, "WARMUP", 0)
    monkeypatch.setattr(P.time, "perf_counter", fake_counter)
    monkeypatch.setattr("distlab.runtime.noise.NoiseProbe", QuietWindow)  # its clock reads are not the kernels'
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: {0})  # one core: no neighbour to fork
    row = P.probe([kernel("mm")], "cpu")["kernels"]["mm:1|float32|1"]
    assert row["round_s"] == durations
    assert row["s"] == 3.0 and row["repeats"] == 5


def test_the_neighbours_run_the_kernel_being_timed():
    seen = mmap.mmap(-1, 1)  # what the neighbour ran last, shared with it

    def runs(index):
        def call():
            seen[0] = index
            time.sleep(0.001)
        return call

    neighbours = P._Neighbours([runs(1), runs(2)], [1, 1], 1)
    try:
        for index in (1, 0, 1):
            neighbours.select(index)
            deadline = time.monotonic() + 5
            while seen[0] != index + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert seen[0] == index + 1
    finally:
        neighbours.stop()


def test_paused_neighbours_leave_the_machine_to_the_timed_kernel():
    seen = mmap.mmap(-1, 1)

    def call():
        seen[0] = 1
        time.sleep(0.001)

    neighbours = P._Neighbours([call], [1], 1)
    try:
        deadline = time.monotonic() + 5
        while seen[0] != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        neighbours.pause()
        time.sleep(0.05)  # a call under way ends
        seen[0] = 0
        time.sleep(0.05)
        assert seen[0] == 0
    finally:
        neighbours.stop()


def test_with_other_cores_each_kernel_is_also_timed_alone(recorded, monkeypatch):
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: {0, 1})
    row = P.probe([kernel("mm")], "cpu")["kernels"]["mm:1|float32|1"]
    assert row["neighbours"] == 1 and row["alone_s"] > 0
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: {0})
    assert "alone_s" not in P.probe([kernel("mm")], "cpu")["kernels"]["mm:1|float32|1"]  # no core to leave free


@pytest.mark.parametrize("others_cpu_s, busy", [(1e6, True), (0.0, False)])
def test_the_probe_records_what_other_processes_used_while_it_timed_by_the_runs_rule(recorded, monkeypatch,
                                                                                     others_cpu_s, busy):
    """The machine's busy CPU time (/proc/stat) forced: the window saw others_cpu_s beyond the
    probe's own (a quiet reading: the machine's count did not move, so nothing was others')."""
    readings = iter([100.0, 100.0 + others_cpu_s])
    monkeypatch.setattr("distlab.runtime.noise.machine_busy_seconds", lambda: next(readings))
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: {0, 1})
    noise = P.probe([kernel("mm")], "cpu")["noise"]
    assert noise["busy"] is busy
    assert noise["machine_cores"] == 2 and noise["job_cores"] == 2 and noise["free_cores"] == 0  # it holds both
    assert noise["ranks_cpu_s"] >= 0 and "neighbours" in noise["how"]
    if not busy:
        assert noise["others_cpu_s"] == 0.0


def test_a_killed_neighbours_cpu_time_is_counted_as_the_probes_own():
    def spin():
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass

    neighbours = P._Neighbours([spin], [1], 1)
    time.sleep(0.3)
    assert neighbours.stop() > 0


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["zero3", "fsdp"])
def test_a_sharded_runs_probe_also_times_the_toy_step_wrapped_as_the_run_wraps_it(tmp_path, wrapper):
    """A ZeRO-3 or FSDP key's probe (distlab.tools.step_time.sharding_wrapper) holds its key's
    kernels and one more: the toy-width step wrapped on a one-rank group of the probe's own."""
    config, path = tiny_config_json(tmp_path)
    shape = model_shape(config)
    key = f"{KEY}-{wrapper}"
    wanted = {f"{k['key']}|{k['dtype']}|{k['threads']}" for k in kernels_needed(key, shape, parameter_counts(shape))}
    plain = {f"{k['key']}|{k['dtype']}|{k['threads']}" for k in kernels_needed(KEY, shape, parameter_counts(shape))}
    assert wanted - plain == {f"wrapped-{wrapper}:2x32|float32|1"}
    run_probe(str(path), key, "tiny", str(tmp_path / "probe.json"))
    record = json.loads((tmp_path / "probe.json").read_text())
    assert set(record["kernels"]) == wanted and record["kernels"][f"wrapped-{wrapper}:2x32|float32|1"]["s"] > 0
    assert record["noise"]["busy"] in (True, False)
