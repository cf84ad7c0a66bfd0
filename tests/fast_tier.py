"""What keeps the fast tier (`pytest -m "not slow"`) fast, read from the test files' source
rather than from timings: a test outside `slow` starts no training ranks, no Ray cluster and no
real (not dry-run) workflow, neither itself nor through a fixture or a helper of the tests/
folder. tests/test_fast_tier.py holds every test file to it; no import of the test modules."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# The doors that start ranks, a Ray cluster, a warm server or a workflow (the harness's and distlab's).
LAUNCHING_CALLS = {
    "run_experiment",  # distlab.testing: one experiment through the real launcher
    "launch",  # distlab.jobs.launch
    "validate_run",  # distlab.jobs.validate: the validation ranks
    "run_ranks", "start_ranks", "run_tree", "run_trees",  # distlab.launchers.process / ranks
    "RayNodes",  # distlab.launchers.ray_nodes: `ray start` nodes
    "start_snakemake",  # test_hygiene: a real `snakemake --cores 2` in the background
    "build_wheels",  # benchmarks/gpu_wheels: the GPU kit's wheel set, downloaded and built
}
# Scripts that run the workflow (the GPU kit runs it wherever a GPU is; its checks first take ~10-40 s).
LAUNCHING_SCRIPTS = {"gpu_check.sh"}
SUBPROCESS_CALLS = {"run", "Popen", "call", "check_call", "check_output"}
# Fixtures that are a finished real workflow run (tests/report_fixtures.py).
LAUNCHING_FIXTURES = {"finished_pipeline"}
# Snakemake flags that run no job.
DRY_RUN_FLAGS = {"-n", "--dry-run", "--dryrun", "--lint"}
# Modules whose fixtures every test module sees (conftest.py) or imports (the plugins).
SHARED_FIXTURE_MODULES = ("conftest", "report_fixtures", "warm_fixtures")


def _dotted(node) -> str:
    """`pytest.mark.slow` for that attribute chain ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _marks_slow(node) -> bool:
    """Whether a decorator or a `pytestmark` value is (or lists) pytest.mark.slow."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_marks_slow(element) for element in node.elts)
    return _dotted(node) == "pytest.mark.slow"


def _is_fixture(func: ast.FunctionDef) -> bool:
    return any(_dotted(d.func if isinstance(d, ast.Call) else d) == "pytest.fixture" for d in func.decorator_list)


def _is_autouse(func: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and any(k.arg == "autouse" and getattr(k.value, "value", False)
                                                   for k in d.keywords) for d in func.decorator_list)


def _string_args(call: ast.Call) -> set[str]:
    """The string constants among a call's arguments, also inside a list argument."""
    found = set()
    for arg in call.args:
        for node in ast.walk(arg):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


@dataclass
class Module:
    name: str
    functions: dict = field(default_factory=dict)  # name -> FunctionDef (top level)
    imported: dict = field(default_factory=dict)  # name -> (module, name) of another test-folder module
    slow: bool = False  # module-level pytestmark includes slow

    @classmethod
    def parse(cls, path: Path) -> "Module":
        module = cls(path.stem)
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef):
                module.functions[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module and (path.parent / f"{node.module}.py").is_file():
                for alias in node.names:
                    module.imported[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Assign) and any(_dotted(t) == "pytestmark" for t in node.targets):
                module.slow = _marks_slow(node.value)
        return module


class Checker:
    """Why each test outside `slow` would launch something (none for a fast tier that stays fast)."""

    def __init__(self, folder: Path = TESTS):
        self.folder = folder
        self.modules: dict[str, Module] = {}

    def module(self, name: str) -> Module:
        if name not in self.modules:
            self.modules[name] = Module.parse(self.folder / f"{name}.py")
        return self.modules[name]

    def resolve(self, module: Module, name: str):
        """(module, FunctionDef) a name of `module` refers to within the test folder, else None."""
        if name in module.functions:
            return module, module.functions[name]
        if name in module.imported:
            other, original = module.imported[name]
            return self.resolve(self.module(other), original)
        return None

    def fixture(self, module: Module, name: str):
        found = self.resolve(module, name)
        if found is None:  # conftest's, or a plugin's (pytest_plugins) the module does not import by name
            for shared in SHARED_FIXTURE_MODULES:
                if (self.folder / f"{shared}.py").is_file() and name in self.module(shared).functions:
                    found = self.module(shared), self.module(shared).functions[name]
                    break
        return found if found and _is_fixture(found[1]) else None

    def reasons(self, module: Module, func: ast.FunctionDef, seen: set | None = None) -> list[str]:
        """What `func` (a test, fixture or helper of `module`) launches, with the path to it."""
        seen = set() if seen is None else seen
        if (module.name, func.name) in seen:
            return []
        seen.add((module.name, func.name))
        found = []
        for arg in func.args.args:
            if arg.arg in LAUNCHING_FIXTURES:
                found.append(f"fixture {arg.arg}")
            elif fixture := self.fixture(module, arg.arg):
                found += [f"fixture {arg.arg} -> {why}" for why in self.reasons(*fixture, seen)]
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            strings = _string_args(node)
            if name in LAUNCHING_CALLS:
                found.append(f"calls {name}")
            elif strings & LAUNCHING_SCRIPTS and name in SUBPROCESS_CALLS:
                found.append(f"runs {sorted(strings & LAUNCHING_SCRIPTS)[0]}")
            elif name == "init" and _dotted(node.func) == "ray.init":
                found.append("calls ray.init")
            elif (name == "snakemake" or "snakemake" in strings) and not strings & DRY_RUN_FLAGS:
                found.append(f"runs the workflow: {name}(...) without {sorted(DRY_RUN_FLAGS)}")
            elif isinstance(node.func, ast.Name) and (helper := self.resolve(module, name)):
                found += [f"{name} -> {why}" for why in self.reasons(*helper, seen)]
        return found

    def offenders(self) -> dict[str, list[str]]:
        """{test id: reasons} for every test outside `slow` that launches something."""
        found = {}
        for path in sorted(self.folder.glob("test_*.py")):
            module = self.module(path.stem)
            if module.slow:
                continue
            autouse = [f for f in module.functions.values() if _is_fixture(f) and _is_autouse(f)]
            for name, func in module.functions.items():
                if not name.startswith("test_") or any(_marks_slow(d) for d in func.decorator_list):
                    continue
                why = [r for f in [func, *autouse] for r in self.reasons(module, f)]
                if why:
                    found[f"{path.name}::{name}"] = why
        return found
