"""Preflight of the GPU check kit: is this machine able to run it, and if not, what exactly is missing.

    python -m distlab.tools.gpu_preflight [--min-free-gib 8]

Run first by benchmarks/gpu_check.sh, after the carried wheels are installed and before
Snakemake starts, so that a missing package or an old torch costs seconds, not a half-run
kit. It checks, in this order, and prints one line per problem:
  1. torch is importable and at least the project's lowest supported version (the `torch`
     requirement of pyproject.toml);
  2. every module the kit's jobs import, and every installed distribution those need
     (Requires-Dist, recursively: a snakemake without platformdirs is caught here, not
     40 s into the run);
  3. the torch APIs distlab calls exist, or a fallback for them does;
  4. CUDA is visible to torch, with at least --min-free-gib free on every device.
Exit status: 0 ready; 2 everything is installed but there is no CUDA GPU; 3 anything else.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent.parent / "pyproject.toml"

# Module imported by the kit's jobs -> the distribution that installs it. Ray is left out:
# the kit's config has no Ray experiment and distlab imports ray only inside its launcher.
KIT_MODULES = {
    "torch": "torch", "transformers": "transformers", "peft": "peft", "accelerate": "accelerate",
    "datasets": "datasets", "tokenizers": "tokenizers", "deepspeed": "deepspeed", "snakemake": "snakemake",
    "snakemake.api": "snakemake", "jsonschema": "jsonschema", "yaml": "pyyaml", "pandas": "pandas",
    "matplotlib": "matplotlib", "pynvml": "nvidia-ml-py", "safetensors": "safetensors", "psutil": "psutil",
}

# (module, attribute, alternatives): distlab calls the attribute, or the first alternative
# that exists (its fallback for older torch). Every entry must exist from torch 2.6 on.
TORCH_APIS = [
    ("torch", "OutOfMemoryError", ("torch.cuda.OutOfMemoryError",)),
    ("torch.distributed", "all_gather_single", ("torch.distributed.all_gather_into_tensor",)),
    ("torch.distributed", "reduce_scatter_single", ("torch.distributed.reduce_scatter_tensor",)),
    ("torch.distributed.fsdp", "fully_shard", ()),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", ()),
    ("torch.distributed.fsdp", "CPUOffloadPolicy", ()),
    ("torch.distributed.checkpoint.state_dict", "get_state_dict", ()),
    ("torch.distributed.checkpoint.state_dict", "set_state_dict", ()),
    ("torch.distributed.tensor", "DTensor", ()),
    ("torch.distributed.tensor.parallel", "parallelize_module", ()),
    ("torch.distributed.pipelining", "ScheduleGPipe", ()),
    ("torch.distributed.device_mesh", "init_device_mesh", ()),
]


class Report:
    def __init__(self):
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.warnings: list[str] = []
        self.no_gpu: str | None = None

    def lines(self) -> list[str]:
        out = [f"gpu_check preflight: MISSING: {p}" for p in self.problems]
        out += [f"gpu_check preflight: warning: {w}" for w in self.warnings]
        if self.no_gpu:
            out.append(f"gpu_check preflight: {self.no_gpu}")
        return out

    @property
    def status(self) -> int:
        return 3 if self.problems else 2 if self.no_gpu else 0  # warnings alone do not stop the kit


def lowest_supported_torch(pyproject: Path = PYPROJECT) -> str:
    """The lower bound of pyproject.toml's torch requirement (e.g. '2.6')."""
    text = pyproject.read_text()
    match = re.search(r'"torch\s*>=\s*([0-9][0-9.]*)', text)
    if not match:
        raise ValueError(f"{pyproject}: no 'torch>=X' requirement found")
    return match.group(1)


def _version_tuple(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); a pre-release counts as its release."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _quiet_import(name: str):
    """Import a module; its import-time chatter (deepspeed's, say) does not reach the kit's output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return importlib.import_module(name)


def check_torch(report: Report, minimum: str):
    try:
        torch = _quiet_import("torch")
    except ImportError as exc:
        report.problems.append(f"torch is not installed ({exc}); the kit needs torch>={minimum} "
                               "with CUDA (on the GPU box, the image's own python3 has it)")
        return None
    if _version_tuple(torch.__version__) < _version_tuple(minimum):
        report.problems.append(f"torch {torch.__version__} is older than the lowest supported {minimum} "
                               f"(pyproject.toml: torch>={minimum})")
    return torch


def check_modules(report: Report, modules: dict[str, str] = KIT_MODULES) -> None:
    for module, dist in modules.items():
        if module == "torch":
            continue
        try:
            _quiet_import(module)
        except Exception as exc:  # ImportError, or a module that breaks while importing
            kind = "not installed" if isinstance(exc, ModuleNotFoundError) else "fails to import"
            report.problems.append(f"{module} ({dist}) {kind}: {type(exc).__name__}: {exc}"
                                   + ("; carry its wheel (benchmarks/gpu_wheels.sh)" if kind == "not installed"
                                      else ""))


def missing_requirements(dists: list[str], conflicts: list[str] | None = None) -> list[str]:
    """'<dist> needs <req> (not installed)' for each unmet non-optional Requires-Dist, recursively.

    Version mismatches go to `conflicts` when given: they are reported, not fatal (the box's
    own builds are often newer than a pin, and such a package usually imports fine)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen, todo, missing = set(), list(dists), []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # reported by whoever needed it (or by check_modules)
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                installed = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                missing.append(f"{name} needs {req} (not installed)")
                continue
            if conflicts is not None and req.specifier and not req.specifier.contains(installed, prereleases=True):
                conflicts.append(f"{name} asks for {req}, {req.name} {installed} is installed")
            todo.append(req.name)
    return sorted(set(missing))


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(_quiet_import(module), attr)


def check_torch_apis(report: Report, apis=TORCH_APIS) -> None:
    for module, attr, alternatives in apis:
        for candidate in (f"{module}.{attr}",) + tuple(alternatives):
            try:
                _resolve(candidate)
            except (ImportError, AttributeError):
                continue
            if candidate != f"{module}.{attr}":
                report.notes.append(f"{module}.{attr} absent; distlab falls back to {candidate}")
            break
        else:
            report.problems.append(f"torch API {module}.{attr} is missing (and no fallback: "
                                   f"{', '.join(alternatives) or 'none'})")


def check_cuda(report: Report, torch, min_free_gib: float) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        report.no_gpu = (f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: "
                         f"{torch.version.cuda or 'none, a CPU-only build'}); nothing was run.")
        return
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        report.notes.append(f"cuda:{index} {name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
        if free < min_free_gib * 2**30:
            report.problems.append(f"cuda:{index} ({name}) has {free / 2**30:.1f} GiB free; the kit needs "
                                   f"{min_free_gib:g} GiB (another process holds the GPU?)")


def preflight(min_free_gib: float = 8.0, modules: dict[str, str] = KIT_MODULES, cuda: bool = True) -> Report:
    """cuda=False: a CPU rehearsal of the kit (benchmarks/gpu_check.sh with
    DISTLAB_KIT_CPU_REHEARSAL=1): everything but step 4, which is said not to have run."""
    report = Report()
    torch = check_torch(report, lowest_supported_torch())
    check_modules(report, modules)
    conflicts: list[str] = []
    for line in missing_requirements(sorted(set(modules.values()) - {"torch"}), conflicts):
        report.problems.append(line)
    report.warnings.extend(conflicts)
    if torch is not None:
        check_torch_apis(report)
        if not report.problems and cuda:
            check_cuda(report, torch, min_free_gib)
    if not cuda:
        report.notes.append("CPU rehearsal: CUDA and GPU memory not checked (torch "
                            f"{getattr(torch, '__version__', '?')})")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-free-gib", type=float, default=8.0, help="free memory each GPU must have")
    parser.add_argument("--verbose", action="store_true", help="also print what was found (versions, memory)")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="check everything but CUDA (the kit on CPU)")
    args = parser.parse_args(argv)
    report = preflight(args.min_free_gib, cuda=not args.cpu_rehearsal)
    for line in report.lines():
        print(line, file=sys.stderr)
    if args.verbose or report.status == 0:
        for note in report.notes:
            print(f"gpu_check preflight: {note}")
    return report.status


if __name__ == "__main__":
    sys.exit(main())
