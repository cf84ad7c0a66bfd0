"""Checks of everything a job would read, run when the Snakefile is parsed (before any job).

Snakemake deletes a job's outputs before it runs the job: bad input found inside a job
costs the finished result it replaces. So every input that can be read cheaply is read
here, and each error names the config field and the file:
- numbers: finite, and whole where the schema says integer (JSON Schema counts 2.0 as an
  integer and NaN as a number; `world_size: 2.0` and `lr: .nan` are refused here);
- results_dir: not empty, not a system or shared folder, not the project or its sources,
  no unexpanded '~', no '{' or '}' (wildcards to Snakemake), writable; `machine` not a name the results
  folder already uses for something else;
- model folders: config.json parses (file and line named), no custom code (auto_map), every
  parameter of the architecture stored with its shape (distlab.configuration.model_files);
- Ray addresses: $RAY_ADDRESS set and non-empty where asked for, every head reachable
  within a timeout and driven with token auth (RAY_AUTH_MODE=token and a token). These, and results_dir
  being writable, look at the machine: only
  `distlab.configuration.config.load(..., probe=True)` runs them (the workflow does; unit tests do not).
Data-file content is checked by distlab.configuration.data_checks.
"""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import jsonschema
import yaml

from distlab.errors import ConfigError
from distlab.records.sharing import PROJECT_ROOT

# Folders under results_dir that are not machine folders.
RESERVED_MACHINE_NAMES = {"prep", "report", "logs", "kuberay", ".gpu-locks"}
# Never write results into these (or at the root itself).
SYSTEM_FOLDERS = ("/proc", "/sys", "/dev", "/boot", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/usr", "/run")
# Nor these themselves (folders below them are fine), nor the home folder itself.
SHARED_FOLDERS = ("/home", "/var", "/opt", "/srv", "/mnt", "/media", "/tmp", "/root")
# Nor the project itself or its sources (a machine folder named like one would land among them,
# and the report writes <results_dir>/report/).
SOURCE_FOLDERS = (".git", ".ci", "benchmarks", "config", "distlab", "envs", "profiles", "report", "rules", "scripts",
                  "tests")
WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "*.pt", "*.pth")
RAY_PROBE_TIMEOUT_S = 5.0


def _strict_integer(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


def _finite_number(checker, instance) -> bool:
    return isinstance(instance, (int, float)) and not isinstance(instance, bool) and math.isfinite(instance)


# A draft 2020-12 validator where 2.0 is not an integer and NaN/inf are not numbers.
StrictValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _strict_integer, "number": _finite_number}),
)


def yaml_file(path: str | os.PathLike) -> dict:
    """Load a YAML config file; a syntax error names the file and the line."""
    try:
        with open(path) as fh:
            return yaml.safe_load(fh) or {}
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        raise ConfigError(f"config file {where}: YAML syntax error: {error.problem or error}") from None


def check_config_syntax(path: str | os.PathLike) -> None:
    """The Snakefile's check of the embedded default config file, as a WorkflowError."""
    if os.path.isfile(path):
        try:
            yaml_file(path)
        except ConfigError as error:
            from snakemake.exceptions import WorkflowError

            raise WorkflowError(str(error)) from None


def refuse_wildcard_braces(field: str, folder: str) -> None:
    """Snakemake reads '{...}' in a path as a wildcard: a results folder named so would stop the
    workflow with an error that names no folder."""
    if "{" in str(folder) or "}" in str(folder):
        raise ConfigError(f"config field '{field}': '{folder}' holds '{{' or '}}', which Snakemake reads as a "
                          "wildcard in every path under it; rename the folder")


def check_results_dir(results_dir: str, probe: bool = False) -> None:
    if not str(results_dir).strip():
        raise ConfigError("config field 'results_dir': empty; name a folder (e.g. results)")
    if str(results_dir).strip().startswith("~"):
        raise ConfigError(f"config field 'results_dir': '{results_dir}': '~' is not expanded here (it would make a "
                          "folder named '~'); write the full path")
    refuse_wildcard_braces("results_dir", results_dir)
    folder = Path(results_dir).resolve()
    shared = folder == Path("/") or folder == Path.home() or any(folder == Path(s) for s in SHARED_FOLDERS)
    if shared or any(folder == Path(s) or Path(s) in folder.parents for s in SYSTEM_FOLDERS):
        raise ConfigError(f"config field 'results_dir': '{results_dir}' is a system or shared folder ({folder}); "
                         "results go into a folder of your own")
    for root in {PROJECT_ROOT, Path.cwd().resolve()}:
        if not (root / "Snakefile").is_file():
            continue
        sources = [root / name for name in SOURCE_FOLDERS]
        if folder == root or any(folder == s or s in folder.parents for s in sources):
            raise ConfigError(f"config field 'results_dir': '{results_dir}' is the project's own folder or one of "
                              f"its sources ({folder}); use a folder of its own (e.g. results)")
    if probe:
        existing = folder
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"config field 'results_dir': '{results_dir}' is not writable "
                             f"({existing} {'is not a folder' if not existing.is_dir() else 'denies writing'})")


def check_machine(machine: str | None) -> None:
    if machine is not None and machine in RESERVED_MACHINE_NAMES:
        raise ConfigError(f"config field 'machine': '{machine}' is the name of a folder the results already use "
                         f"for something else ({', '.join(sorted(RESERVED_MACHINE_NAMES))}); choose another tag")


def model_config(folder: str | os.PathLike, field: str = "model.path", weights: bool = False) -> dict:
    """A model folder's config.json, parsed; weights=True: its weights present too (checked
    where a job will load them: the workflow's probe; the advisor and the GPU presets read
    config-only folders)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"config field '{field}': {path} is not valid JSON (line {error.lineno}, column "
                         f"{error.colno}: {error.msg})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config field '{field}': {path} is not UTF-8 text") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ConfigError(f"config field '{field}': {path} has no model_type (not a Hugging Face model config)")
    if config.get("auto_map"):
        raise ConfigError(f"config field '{field}': {path} names custom code (auto_map: "
                          f"{sorted(config['auto_map'])}); distlab never runs code from a model folder "
                          "(trust_remote_code): use a model whose architecture transformers has")
    if weights and not any(any(Path(folder).glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ConfigError(f"config field '{field}': model folder '{folder}' has no weights "
                         f"({', '.join(WEIGHT_PATTERNS)})")
    if weights:  # every parameter of the architecture stored, sizes plausible (no tensor loaded)
        from distlab.configuration.model_files import check_model_weights

        check_model_weights(folder, field)
    return config


def ray_head(address: str, field: str) -> str:
    """The address a Ray experiment connects to; 'env' reads $RAY_ADDRESS, which must be set."""
    if address == "env":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address.strip():
            raise ConfigError(f"config field '{field}': 'env' takes the Ray head from RAY_ADDRESS, which is "
                             f"{'empty' if 'RAY_ADDRESS' in os.environ else 'not set'}")
    return address


def probe_ray_head(address: str, field: str, timeout: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Connect to host:port (also ray://host:port) once; 'auto' (a local cluster) is left to Ray."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"config field '{field}': Ray head address '{address}' is not host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ConfigError(f"config field '{field}': Ray head {address} is not reachable within {timeout:.0f} s "
                         f"({error})") from None


def check_ray_token_auth(address: str, field: str) -> None:
    """This process will drive `address` with Ray token auth: RAY_AUTH_MODE=token and a token.
    Ray sends no token to an address it is given unless the mode says token, so without it a
    head with auth refuses the driver inside a job, and a head without auth (an open door:
    anyone who reaches it runs code) is used as if nothing were wrong."""
    if address in ("auto", "local"):
        return
    how = ("set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or "
           "~/.ray/auth_token); distlab drives no Ray cluster without token auth (docs/ray.md, home PC + cloud GPU)")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        raise ConfigError(f"config field '{field}': driving Ray head {address} needs token auth, but RAY_AUTH_MODE "
                          f"is {os.environ.get('RAY_AUTH_MODE', 'not set')!r}: {how}")
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"  # Ray's own order
    if not os.environ.get("RAY_AUTH_TOKEN", "").strip() and not os.path.isfile(os.path.expanduser(token_path)):
        raise ConfigError(f"config field '{field}': driving Ray head {address}: no token in RAY_AUTH_TOKEN and no "
                          f"file {token_path}: {how}")


def check_ray_heads(specs: dict[str, dict]) -> None:
    """Every Ray head an experiment names: set, reachable, and driven with token auth (run by
    the workflow only)."""
    probed = set()
    for exp_id, spec in specs.items():
        if spec.launcher != "ray" or spec.ray["address"] is None:
            continue
        field = f"stages.{spec.stage}.experiments ({exp_id}).ray.address"
        address = ray_head(spec.ray["address"], field)
        if address not in probed:
            probe_ray_head(address, field)
            check_ray_token_auth(address, field)
            probed.add(address)
