"""What the README and its pages under docs/ tell a user to type or to expect about safety
holds for the code: every command that starts, joins or drives a Ray cluster turns token auth
on as distlab's own clusters do, the KubeRay section names what the manifests are checked
against, and the results-folder lock is cleared the way its refusal says."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from conftest import REPO

README = (REPO / "README.md").read_text()
# The user's documentation: the README and one page per topic under docs/.
DOC_PAGES = {path.relative_to(REPO).as_posix(): path.read_text()
             for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
USER_DOCS = "\n\n".join(DOC_PAGES.values())
FENCE = re.compile(r"^\s*```")
# A Ray command someone will paste: `ray start` with an option given a value, or a driver
# pointed at a head. A bare `ray start --head` in prose names the command, it is not one.
RAY_COMMAND = re.compile(r"\bray start\b.*=|RAY_ADDRESS=", re.DOTALL)


def readme_code(text: str = USER_DOCS) -> tuple[list[str], list[str]]:
    """(code block lines, inline code spans of the prose) of the README and docs/ (or of `text`)."""
    blocks, prose = [], []
    in_fence, after_blank, in_indented = False, True, False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        indented = line.startswith("    ") and line.strip()
        in_indented = bool(indented) and (in_indented or after_blank)
        if in_fence or in_indented:
            blocks.append(line.strip())
        else:
            prose.append(line)
        after_blank = not line.strip()
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", "\n".join(prose))]
    return blocks, spans


def section(title: str) -> str:
    """The text under the one heading `title` of the README or a docs/ page, up to the next heading."""
    heading = re.compile(rf"^#+ {re.escape(title)}$", re.MULTILINE)
    found = [(page, match) for page, text in DOC_PAGES.items() for match in heading.finditer(text)]
    assert len(found) == 1, f"heading {title!r} is in {[page for page, _ in found]}, not in exactly one page"
    page, match = found[0]
    text = DOC_PAGES[page]
    end = text.find("\n#", match.start() + 1)
    return text[match.start():end if end != -1 else len(text)]


def test_every_readme_command_that_starts_joins_or_drives_a_ray_cluster_sets_token_auth(tmp_path):
    """A plain `ray start --head` runs with auth off unless a token file already exists, and
    a node or driver given an address never turns it on by itself (Ray 2.60)."""
    from distlab.launchers.ray_nodes import token_auth_environment

    tested_recipe = token_auth_environment(str(tmp_path))  # what tests/test_ray.py's clusters run with
    blocks, spans = readme_code()
    commands = [c for c in blocks + spans if RAY_COMMAND.search(c)]
    # The head, the joining node and the driver of the two-machine steps, the existing-cluster driver.
    assert len(commands) >= 4, commands
    for command in commands:
        assert "RAY_AUTH_MODE=token" in command and tested_recipe["RAY_AUTH_MODE"] == "token", command
        assert set(tested_recipe) <= set(re.findall(r"\b(RAY_AUTH_\w+)=", command)), command


def test_the_readme_s_kuberay_section_names_what_the_manifests_are_checked_against():
    from distlab.tools.kuberay import SUBMISSION_MODE
    from distlab.tools.kuberay_crd import CRD_DIR, KUBERAY_VERSION

    text = " ".join(section("Kubernetes (KubeRay)").split())
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    secret = schema["properties"]["kubernetes"]["properties"]["auth_secret"]["default"]
    assert f"KubeRay {KUBERAY_VERSION}'s own RayCluster and RayJob CRD schemas" in text
    assert str(CRD_DIR.relative_to(REPO)) + "/" in text and "strict" in text
    assert f"kubectl create secret generic {secret} --from-literal=auth_token=" in text  # the key KubeRay reads
    assert SUBMISSION_MODE in text
    assert "checked by distlab's rules only" not in text


def test_the_readme_clears_a_stale_results_lock_as_the_refusal_says():
    from distlab.configuration.results_lock import LOCK_NAME, busy_message

    refusal = busy_message(Path("RESULTS") / LOCK_NAME, {"host": "h", "pid": 1}, checked=False)
    assert f"delete {Path('RESULTS') / LOCK_NAME}" in refusal
    documented = " ".join(USER_DOCS.split())
    assert f"delete `<results_dir>/{LOCK_NAME}` by hand" in documented


def test_the_readme_and_ci_install_what_ci_tested_into_a_fresh_venv():
    """A fresh machine gets the versions the suite passed with: both commands make a venv and
    install with constraints.txt, which pins every dependency within pyproject.toml's ranges."""
    import tomllib

    from packaging.requirements import Requirement

    run_command = next(line for line in readme_code(README)[0] if "snakemake --cores all" in line and "pip" in line)
    ci = (REPO / ".ci" / "run").read_text()
    for text in (run_command, ci):
        assert "-m venv" in text and "-c constraints.txt" in text, text
    assert 'rm -rf "$venv"' in ci  # fresh each time, never a venv with leftovers
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(spec)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(requirement))
