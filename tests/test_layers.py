"""distlab's packages layer by when their code runs: parse time, then job time, then rank time,
then the report. The units are in one order, earliest first, within a layer too: a module imports
only from its own unit or the units before it, counting imports inside functions and dynamic ones
(`importlib.import_module("distlab...")`, a `"distlab.x:attr"` target handed to a lazy loader),
so the packages form no cycle. The table is here once; ARCHITECTURE.md shows the same one, in
the same order (checked below). Parsed with ast: no torch."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from fnmatch import fnmatch
from pathlib import Path

from test_import_cycles import import_cycles as cycles  # Tarjan's strongly connected components

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "distlab"

# The layers, earliest first: (name, when its code runs, its units, earliest first). A unit is a
# package of distlab or one of its top-level modules.
LAYERS = [
    ("foundation", "everywhere: importing nothing of distlab", ["errors", "registry"]),
    ("bottom", "parse time, and the files every later phase reads", ["records", "configuration"]),
    ("prep", "data prep jobs, before any training job", ["data_prep"]),
    ("job", "in a Snakemake job, around the ranks it starts", ["launchers", "jobs"]),
    ("kernels", "inside a rank: what it is built from", ["runtime", "checkpoints", "checkpoint_formats",
                                                          "strategies", "tasks"]),
    ("tools", "on their own: advisor, step-time model, probes, benchmarks, the GPU kit", ["tools"]),
    ("rank", "inside a rank, at its top: entry modules and the loop", ["rank"]),
    ("report", "in the summary and report rules", ["report"]),
    ("harness", "tests and benchmarks", ["testing"]),
]
# What a layer may read when it is not every unit before its own.
READS_ONLY = {"foundation": set(), "report": {"foundation", "bottom", "report"}}
# Declarations run at parse time wherever they live: they count as `configuration`. A strategy's
# torch-free settings stay beside its module ("a strategy is its files"), and the registries of
# strategies, tasks and launchers are the lists of names a config may use.
DECLARATIONS = ["distlab/strategies/__init__.py", "distlab/strategies/settings.py",
                "distlab/strategies/*_settings.py", "distlab/tasks/__init__.py",
                "distlab/launchers/__init__.py"]
# Units of one layer that must not import each other at all.
APART = [("strategies", "tasks")]  # a strategy names no task, a task no strategy

# Imports against the order, not yet fixed: "file -> module": why it is still there and what
# would take it off. The list only shrinks: an entry that no longer matches such an import fails.
KNOWN_UPWARD: dict[str, str] = {}

LAYER_OF = {unit: name for name, _, units in LAYERS for unit in units}
ORDER = {unit: i for i, unit in enumerate(unit for _, _, units in LAYERS for unit in units)}


def unit_of(path: Path) -> str:
    rel = path.relative_to(REPO).as_posix()
    if any(fnmatch(rel, pattern) for pattern in DECLARATIONS):
        return "configuration"
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def modules() -> dict[str, Path]:
    """{dotted name: path} of every module of distlab (a package by its __init__), vendor aside."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "vendor" in path.relative_to(PACKAGE).parts:
            continue
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


DYNAMIC = re.compile(r"^(distlab(?:\.\w+)+):\w+$")


def imports(path: Path, known: dict[str, Path], source: str | None = None) -> list[tuple[int, str]]:
    """(line, distlab module) for every import in the file (or in `source`, read as that file):
    module level, inside functions, `importlib.import_module("distlab...")` (an f-string by its
    constant start) and "distlab.module:attribute" lazy targets."""
    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    name = next(n for n, p in known.items() if p == path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    registry = any(fnmatch(path.relative_to(REPO).as_posix(), p) for p in DECLARATIONS)
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        wanted = []
        if isinstance(node, ast.Import):
            wanted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            wanted = [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and DYNAMIC.match(node.value)
              and not registry):  # a registry's entries are its documented lazy plugin loading
            wanted = [DYNAMIC.match(node.value).group(1)]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args):
            arg = node.args[0]
            text = (arg.value if isinstance(arg, ast.Constant) else
                    arg.values[0].value if isinstance(arg, ast.JoinedStr) and arg.values
                    and isinstance(arg.values[0], ast.Constant) else "")
            if isinstance(text, str) and text.startswith("distlab."):
                wanted = [text.rstrip(".")]
        for dotted in wanted:
            if dotted.split(".")[0] == "distlab":
                module = module_of(dotted)
                if module and module != name and module != "distlab":
                    found.append((node.lineno, module))
    return found


def edges() -> list[tuple[str, str, str, str, int]]:
    """(from unit, to unit, file, module, line) for every import between two units."""
    known = modules()
    found = []
    for path in sorted(set(known.values())):
        source = unit_of(path)
        if source not in LAYER_OF:
            continue  # distlab/__init__.py: a docstring
        for line, module in imports(path, known):
            target = unit_of(known[module])
            if target != source:
                found.append((source, target, path.relative_to(REPO).as_posix(), module, line))
    return found


def is_upward(source: str, target: str) -> bool:
    mine, theirs = LAYER_OF[source], LAYER_OF[target]
    if mine in READS_ONLY:
        return theirs not in READS_ONLY[mine]
    return ORDER[target] > ORDER[source] or ({source, target} in [set(p) for p in APART])


def upward(found) -> dict[str, list[str]]:
    """{"file -> module": ["file:line (unit, layer -> unit, layer)", ...]} of every import
    pointing to a later unit (or across units kept apart)."""
    bad = defaultdict(list)
    for source, target, file, module, line in found:
        if is_upward(source, target):
            bad[f"{file} -> {module}"].append(
                f"{file}:{line} imports {module} ({source}, {LAYER_OF[source]} -> {target}, {LAYER_OF[target]})")
    return bad


def test_every_unit_has_one_layer_and_every_layer_its_units():
    units = {unit_of(p) for p in modules().values()} - {"__init__"}
    assert units <= set(LAYER_OF), f"units on no layer: {sorted(units - set(LAYER_OF))}"
    assert sum(len(u) for _, _, u in LAYERS) == len(LAYER_OF), "a unit on two layers"
    for key, why in KNOWN_UPWARD.items():
        assert key.count(" -> ") == 1 and why, key


def test_no_package_imports_a_later_phase():
    bad = upward(edges())
    new = {key: where for key, where in bad.items() if key not in KNOWN_UPWARD}
    assert not new, "imports pointing to a later phase (move the shared code down, or pass it in):\n" + \
        "\n".join(w for where in new.values() for w in where)
    gone = sorted(set(KNOWN_UPWARD) - set(bad))
    assert not gone, f"KNOWN_UPWARD entries that no longer import upward, take them off: {gone}"


def test_packages_form_no_cycle():
    """Counting every import but the known ones (the order above implies it; this names the cycle
    an import against the order would close)."""
    graph, where = defaultdict(set), defaultdict(list)
    for source, target, file, module, line in edges():
        if f"{file} -> {module}" not in KNOWN_UPWARD:
            graph[source].add(target)
            where[source, target].append(f"{file}:{line} imports {module}")
    found = cycles(graph)
    assert not found, "package cycles:\n" + "\n".join(
        " <-> ".join(sorted(c)) + ":\n  " + "\n  ".join(w for a in sorted(c) for b in sorted(graph[a] & c)
                                                     for w in where[a, b]) for c in found)


def test_the_checks_see_a_function_level_a_dynamic_and_a_cyclic_import():
    known = modules()
    found = imports(known["distlab.tasks.causal_lm"], known)
    assert any(m == "distlab.runtime.model" for _, m in found)  # lazy("distlab.runtime.model:load_model")
    hidden = ("def f(name):\n    import importlib\n    importlib.import_module('distlab.rank.loop')\n"
              "    return importlib.import_module(f'distlab.jobs.{name}')\n")
    assert imports(known["distlab.records.metrics"], known, hidden) == \
        [(3, "distlab.rank.loop"), (4, "distlab.jobs")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert is_upward("records", "runtime") and is_upward("report", "tools") and is_upward("tasks", "strategies")
    assert not is_upward("runtime", "records") and not is_upward("report", "records")
    # Within a layer the order holds too: configuration reads records, jobs start ranks through the
    # launchers, the checkpoints and strategies build on the kernels.
    assert is_upward("records", "configuration") and is_upward("launchers", "jobs")
    assert is_upward("runtime", "checkpoints") and is_upward("checkpoints", "checkpoint_formats")
    assert not is_upward("strategies", "runtime") and not is_upward("rank", "tools")


# The package __init__s that hold more than their docstring, and what.
INIT_CODE = {"launchers": "the launcher registry", "strategies": "the strategy registry",
             "tasks": "the task registry", "checkpoint_formats": "format.json's writer and reader"}


def test_every_package_init_says_when_its_code_runs_and_only_the_registries_hold_code():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        if init.parent.name == "vendor":
            continue
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(REPO)} says nothing of when its code runs"
        code = [n for n in tree.body[1:] if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
        assert bool(code) == (init.parent.name in INIT_CODE), \
            f"{init.relative_to(REPO)}: code in an __init__ is only a registry's (INIT_CODE)"


def test_architecture_md_shows_this_layer_table():
    text = (REPO / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| (\d) \| (\w+) \|[^|]*\| ([^|]*) \|", text, re.M)
    shown = [(name, re.findall(r"`(?:distlab/)?(\w+)(?:/|\.py)`", units)) for _, name, units in rows]
    assert shown == [(name, units) for name, _, units in LAYERS], shown
