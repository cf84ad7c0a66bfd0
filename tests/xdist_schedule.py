"""The order tests/conftest.py hands the xdist groups out in, derived from each group's recorded
wall seconds (tests/durations.json) rather than kept by hand.

With --no-loadscope-reorder (pyproject.toml's addopts) xdist gives groups to idle workers in
collection order; by default it would sort them by their number of tests, which put the few-test
long groups last, one running alone at the end while the other worker idled. So the longest go
first: a group's recorded seconds, or, for a group not recorded yet (a new module, or a file
recorded from part of the suite), SLOW_TEST_SECONDS per `slow` test it holds (its other tests
count nothing). An overestimate only moves a group earlier, which costs little; a long group
handed out last is what costs. A memory-heavy group (one lock shared by the workers,
conftest.MEMORY_HEAVY) never follows another while a light one is left, so that the worker
that waits on the lock has something to run meanwhile. Ties keep collection order.

tests/durations.json is checked in and changes only when asked, by a run without -m or -k:
    python -m pytest -n 2 --dist loadgroup tests --record-durations
(or over some test files: their groups' entries are replaced, the others kept). It holds the
summed setup, call and teardown seconds of each group's tests (a module-scoped fixture's cost
is in its first test's setup; a memory-heavy group's includes its wait for the lock)."""
from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
# What a group not in durations.json is counted for each of its slow tests (one tiny 2-rank run
# with its process starts is about 10-60 s here).
SLOW_TEST_SECONDS = 60


def group_of(module: str, shared_groups: dict) -> str:
    """A module's xdist group: the shared group that lists it, else the module itself."""
    return next((name for name, modules in shared_groups.items() if module in modules), module)


def order_groups(groups: list[str], seconds: dict, memory_heavy: set, slow_tests: dict) -> list[str]:
    """`groups` (distinct, in collection order) in the order to hand them out (module docstring);
    seconds: durations.json's; slow_tests: each group's number of tests marked slow."""
    def expected(group):
        return seconds.get(group, SLOW_TEST_SECONDS * slow_tests.get(group, 0))

    queue = sorted(groups, key=lambda group: -expected(group))
    ordered = []
    while queue:
        pick = queue[0]
        if ordered and ordered[-1] in memory_heavy and pick in memory_heavy:
            pick = next((group for group in queue if group not in memory_heavy), pick)
        queue.remove(pick)
        ordered.append(pick)
    return ordered


def read_durations(path: Path = DURATIONS) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class Recorder:
    """A pytest plugin (registered by conftest.py for --record-durations, in the controller
    process): sums each group's reported seconds and merges them into durations.json at the end."""

    def __init__(self, shared_groups: dict, path: Path = DURATIONS):
        self.shared_groups, self.path, self.seconds = shared_groups, path, {}

    def pytest_runtest_logreport(self, report):
        module = Path(report.nodeid.split("::", 1)[0]).stem
        group = group_of(module, self.shared_groups)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        options = session.config.option
        if options.markexpr or options.keyword:
            # A selection times part of a group: only a full run says how long each one takes.
            print(f"\n--record-durations: {self.path.name} left as it was (-m/-k selected part of the suite)")
            return
        merged = {**read_durations(self.path), **{g: round(s, 1) for g, s in self.seconds.items()}}
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
        print(f"\n--record-durations: {len(self.seconds)} group(s) written to {self.path}")
