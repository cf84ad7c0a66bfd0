"""ARCHITECTURE.md is the map a new engineer reads first: every module it names exists, and
every module of the package is on it."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT = (REPO / "ARCHITECTURE.md").read_text()


def test_every_path_architecture_md_names_exists():
    named = {m for m in re.findall(r"(?<![\w/])(distlab/[\w/]+\.(?:py|yaml))", TEXT)}
    assert named, "ARCHITECTURE.md names no module path"
    missing = sorted(path for path in named if not (REPO / path).is_file())
    assert not missing, f"ARCHITECTURE.md names modules that are not there: {missing}"


def test_every_module_of_the_package_is_on_the_map():
    """Named by its file name, or by a pattern the map gives for its kind
    (`distlab/strategies/<name>.py`, `distlab/report/cards/stage<N>_<name>.py`)."""
    patterns = [re.compile(re.sub(r"<\w+>", "[a-z0-9_]+", re.escape(t).replace(r"\<", "<").replace(r"\>", ">")) + "$")
                for t in re.findall(r"distlab/[\w/]*<\w+>[\w<>]*\.py", TEXT)]
    assert patterns, "ARCHITECTURE.md gives no module pattern"
    modules = [p for p in (REPO / "distlab").rglob("*.py") if p.name != "__init__.py" and "vendor" not in p.parts]
    unnamed = sorted(path for path in (str(p.relative_to(REPO)) for p in modules)
                     if Path(path).name not in TEXT and not any(pattern.match(path) for pattern in patterns))
    assert not unnamed, f"modules ARCHITECTURE.md does not name: {unnamed}"
