"""The conda envs of the rules pin versions that pyproject.toml allows."""
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent


def project_requirements() -> dict:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {Requirement(r).name.lower(): Requirement(r) for r in data["project"]["dependencies"]}


def env_pins(path: Path) -> dict:
    env = yaml.safe_load(path.read_text())
    pins = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for line in dep.get("pip", []):
                if "==" in line:
                    req = Requirement(line)
                    pins[req.name.lower()] = next(iter(req.specifier)).version
    return pins


def test_every_env_pin_satisfies_pyproject():
    wanted = project_requirements()
    envs = sorted((REPO / "envs").glob("*.yaml"))
    assert envs
    for env in envs:
        for name, version in env_pins(env).items():
            if name in wanted:
                assert wanted[name].specifier.contains(version, prereleases=True), (env.name, name, version)


def test_training_env_pins_every_library_the_training_rules_import():
    pins = env_pins(REPO / "envs" / "train.yaml")
    for name in ("torch", "transformers", "peft", "accelerate", "deepspeed", "ray", "datasets", "tokenizers",
                 "diffusers", "scikit-learn"):
        assert name in pins, name


def test_every_rule_names_an_env_that_exists():
    for smk in (REPO / "rules").glob("*.smk"):
        for env in re.findall(r'conda:\s*\n\s*"([^"]+)"', smk.read_text()):
            assert (smk.parent / env).resolve().is_file(), (smk.name, env)
