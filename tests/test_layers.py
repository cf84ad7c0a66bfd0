"""distlab's packages layer by when their code runs: parse time, then job time, then rank time,
then the report. A unit is a folder of distlab (or one of its top-level modules), with no
exception: parse-time declarations live in distlab/configuration/, not beside the rank-time code
they declare. The units are in one order, earliest first, within a layer too: a module imports
only from its own unit or the units before it, counting imports inside functions and dynamic ones
(`importlib.import_module("distlab...")` and of an f-string built from `__name__` or
`__package__`, and a `"distlab.x:attr"` target handed to a lazy loader wherever it appears, a
registry's entries included), so the packages form no cycle. The table is here once;
ARCHITECTURE.md shows the same one, in the same order (checked below). Parsed with ast: no torch."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from test_import_cycles import import_cycles as cycles  # Tarjan's strongly connected components

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "distlab"

# The layers, earliest first: (name, when its code runs, its units, earliest first). A unit is a
# folder of distlab or one of its top-level modules, whole.
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
# Units of one layer that must not import each other at all.
APART = [("strategies", "tasks")]  # a strategy names no task, a task no strategy

# Imports against the order, not yet fixed: "file -> module": why it is still there and what
# would take it off. The list only shrinks: an entry that no longer matches such an import fails.
KNOWN_UPWARD: dict[str, str] = {}

LAYER_OF = {unit: name for name, _, units in LAYERS for unit in units}
ORDER = {unit: i for i, unit in enumerate(unit for _, _, units in LAYERS for unit in units)}


def unit_of(path: Path) -> str:
    """The folder of distlab a module is in (a top-level module: its own name)."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


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
# The constant start of an f-string lazy target, "distlab.x.{name}:attr": the package it loads from.
DYNAMIC_START = re.compile(r"^(distlab(?:\.\w+)+)\.$")


def dynamic_module(arg: ast.expr, name: str, package: list[str]) -> str:
    """The distlab module an `import_module` argument names, as far as it is known before it
    runs: a constant, or an f-string by its constant start or by `__name__` / `__package__`
    heading it (`f"{__name__}.{info.name}"`: a module of this package); "" for anything else."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if not isinstance(arg, ast.JoinedStr) or not arg.values:
        return ""
    head = arg.values[0]
    if isinstance(head, ast.Constant) and isinstance(head.value, str):
        return head.value
    if isinstance(head, ast.FormattedValue) and isinstance(head.value, ast.Name):
        return {"__name__": name, "__package__": ".".join(package)}.get(head.value.id, "")
    return ""


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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DYNAMIC.match(node.value):
            wanted = [DYNAMIC.match(node.value).group(1)]  # a lazy target, a registry's entries too
        elif (isinstance(node, ast.JoinedStr) and len(node.values) > 1 and isinstance(node.values[0], ast.Constant)
              and isinstance(node.values[0].value, str) and DYNAMIC_START.match(node.values[0].value)
              and any(isinstance(v, ast.Constant) and ":" in str(v.value) for v in node.values[1:])):
            wanted = [DYNAMIC_START.match(node.values[0].value).group(1)]  # f"distlab.x.{name}:attr"
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args):
            text = dynamic_module(node.args[0], name, package)
            if text.startswith("distlab."):
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
              "    importlib.import_module(f'{__package__}.{name}')\n"
              "    load({name: 'distlab.tools.advisor:main'}, name, 'tool')\n"
              "    load({name: f'distlab.strategies.{name}:STRATEGY'}, name, 'strategy')\n"
              "    return importlib.import_module(f'distlab.jobs.{name}')\n")
    assert sorted(imports(known["distlab.records.metrics"], known, hidden)) == \
        [(3, "distlab.rank.loop"), (4, "distlab.records"), (5, "distlab.tools.advisor"), (6, "distlab.strategies"),
         (7, "distlab.jobs")]
    # Task discovery's import of every module of its package, by the package's own name.
    discovery = ast.parse('importlib.import_module(f"{__name__}.{info.name}")').body[0].value.args[0]
    assert dynamic_module(discovery, "distlab.configuration.tasks", ["distlab", "configuration", "tasks"]) == \
        "distlab.configuration.tasks"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert is_upward("records", "runtime") and is_upward("report", "tools") and is_upward("tasks", "strategies")
    assert not is_upward("runtime", "records") and not is_upward("report", "records")
    # Within a layer the order holds too: configuration reads records, jobs start ranks through the
    # launchers, the checkpoints and strategies build on the kernels.
    assert is_upward("records", "configuration") and is_upward("launchers", "jobs")
    assert is_upward("runtime", "checkpoints") and is_upward("checkpoints", "checkpoint_formats")
    assert not is_upward("strategies", "runtime") and not is_upward("rank", "tools")


# The package __init__s that hold more than their docstring, and what.
# The registries here load code by a name declared in distlab/configuration/.
INIT_CODE = {"launchers": "the launcher registry", "strategies": "a strategy's class by its name",
             "tasks": "a task by its name", "checkpoint_formats": "format.json's writer and reader"}


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
