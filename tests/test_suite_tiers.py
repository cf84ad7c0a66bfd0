"""How the suite runs: the fast tier (`pytest -m "not slow"`) stays fast by what its tests do,
never by their timings (tests/fast_tier.py); the xdist schedule comes from recorded durations
(tests/xdist_schedule.py); CI lints before it tests (.ci/run)."""

from fast_tier import Checker
from xdist_schedule import SLOW_TEST_SECONDS, Recorder, order_groups

from conftest import REPO


def test_no_test_outside_slow_starts_ranks_ray_or_a_real_workflow():
    assert Checker().offenders() == {}


FAKE_CONFTEST = '''
import pytest

def snakemake(workdir, *args):
    return args

@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    return tmp_path_factory.mktemp("prepared")
'''
FAKE_TESTS = '''
import subprocess

import pytest
import ray
from conftest import REPO, snakemake
from distlab.testing import run_experiment
from test_helpers import train_twice

@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    return run_experiment(prepared, tmp_path_factory.mktemp("run"), {})

def plan(work):
    return snakemake(work, "-n", "--cores", "2")

def run(work):
    return snakemake(work, "--cores", "2")

def test_direct(prepared, tmp_path):
    run_experiment(prepared, tmp_path, {})

def test_through_a_fixture(trained):
    pass

def test_through_a_helper(tmp_path):
    run(tmp_path)

def test_through_another_modules_helper(tmp_path):
    train_twice(tmp_path)

def test_the_session_workflow(finished_pipeline):
    pass

def test_ray():
    ray.init(num_cpus=1)

def test_the_gpu_kit(tmp_path):
    subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path)])

def test_reading_the_gpu_kit():
    assert "SNAKEMAKE_CAP_S" in (REPO / "benchmarks" / "gpu_check.sh").read_text()

def test_a_dry_run(tmp_path):
    plan(tmp_path)
    snakemake(tmp_path, "--lint")

def test_a_unit(prepared):
    assert prepared

@pytest.mark.slow
def test_marked(trained):
    run(trained)
'''


def test_the_fast_tier_check_follows_fixtures_helpers_and_imports(tmp_path):
    (tmp_path / "conftest.py").write_text(FAKE_CONFTEST)
    (tmp_path / "test_helpers.py").write_text("from distlab.jobs.launch import launch\n\n"
                                              "def train_twice(job):\n    launch(job)\n    launch(job)\n")
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    (tmp_path / "test_all_slow.py").write_text("import pytest\n\npytestmark = [pytest.mark.slow]\n\n"
                                               "def test_x(finished_pipeline):\n    pass\n")
    offenders = Checker(tmp_path).offenders()
    assert sorted(offenders) == [f"test_fake.py::test_{name}" for name in
                                 ("direct", "ray", "the_gpu_kit", "the_session_workflow", "through_a_fixture",
                                  "through_a_helper", "through_another_modules_helper")]
    assert offenders["test_fake.py::test_through_a_fixture"] == ["fixture trained -> calls run_experiment"]
    assert offenders["test_fake.py::test_through_another_modules_helper"] == ["train_twice -> calls launch"] * 2
    assert "without" in offenders["test_fake.py::test_through_a_helper"][0]


def test_groups_go_longest_first_with_unrecorded_ones_counted_by_their_slow_tests():
    seconds = {"short": 5, "long": 400, "middle": SLOW_TEST_SECONDS * 2 + 1}
    slow = {"new_slow": 3, "new_fast": 0, "long": 7}
    groups = ["new_fast", "short", "middle", "new_slow", "long", "other_new_fast"]
    # new_slow counts 3 x SLOW_TEST_SECONDS; groups with no record and no slow test go last, in order.
    assert order_groups(groups, seconds, set(), slow) == ["long", "new_slow", "middle", "short", "new_fast",
                                                          "other_new_fast"]


def test_a_light_group_goes_between_two_memory_heavy_ones_while_one_is_left():
    seconds = {"heavy_a": 400, "heavy_b": 300, "light": 200, "heavy_c": 100, "tiny": 1}
    heavy = {"heavy_a", "heavy_b", "heavy_c"}
    assert order_groups(list(seconds), seconds, heavy, {}) == ["heavy_a", "light", "heavy_b", "tiny", "heavy_c"]
    # With no light group left, heavy ones follow each other (the lock serialises them).
    assert order_groups(["heavy_a", "heavy_b"], seconds, heavy, {}) == ["heavy_a", "heavy_b"]


class FakeReport:
    def __init__(self, nodeid, duration):
        self.nodeid, self.duration = nodeid, duration


class FakeSession:
    def __init__(self, markexpr="", keyword=""):
        self.config = type("Config", (), {"option": type("Option", (), {"markexpr": markexpr, "keyword": keyword})})


def test_recorded_durations_sum_each_group_and_keep_the_groups_not_run(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text('{"test_old": 12.0, "test_a": 99.0}\n')
    recorder = Recorder({"shared": {"test_b", "test_c"}}, path)
    for nodeid, duration in [("tests/test_a.py::test_1", 1.25), ("tests/test_a.py::test_2", 2.0),
                             ("tests/test_b.py::test_1", 3.0), ("tests/test_c.py::test_1[x]", 4.0)]:
        recorder.pytest_runtest_logreport(FakeReport(nodeid, duration))
    recorder.pytest_sessionfinish(FakeSession(markexpr="not slow"))
    assert path.read_text() == '{"test_old": 12.0, "test_a": 99.0}\n'  # part of a group says nothing
    recorder.pytest_sessionfinish(FakeSession())
    import json

    assert json.loads(path.read_text()) == {"shared": 7.0, "test_a": 3.2, "test_old": 12.0}


def test_ci_lints_the_python_and_the_workflow_before_it_tests():
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    steps = {name: next(i for i, line in enumerate(lines) if needle in line)
             for name, needle in [("ruff", "ruff check"), ("snakefmt", "snakefmt --check"), ("pytest", "-m pytest")]}
    assert steps["ruff"] < steps["pytest"] and steps["snakefmt"] < steps["pytest"], lines
    assert "set -euo pipefail" in lines  # a linter's failure fails CI
    snakefmt = lines[steps["snakefmt"]]
    assert "Snakefile" in snakefmt and "rules" in snakefmt, snakefmt
