"""What a warm-start server (distlab.launchers.warm_server) checks before it forks a copy for a
stand-in, and the thread settings the copy applies: a warm copy is the process a fresh start
would have been, or there is no copy (the stand-in then starts fresh, saying why).

A fork inherits from the server what the kernel and the libraries set up before `exec` or at
import, and no forked interpreter can change them afterwards:
- the request itself: its shape (`shape_error`), an entry module, the same Python and distlab
  checkout, the same hash seed (Python draws it once, at start), and every environment variable
  a library reads while it is imported (`refusal`);
- the process context, read through /proc/<stand-in pid> (the pid from SO_PEERCRED): the
  namespaces (a copy forked in the server's network namespace would leave a link rank's host),
  the cgroup (its CPU and memory limits) and the resource limits (`context_refusal`).
Thread counts are set per launch: the copy sets each thread pool the server loaded to what a
fresh process would have read from the stand-in's environment (`apply_thread_settings`), and a
request whose count a fresh library would have derived from the machine (no variable set) is
refused unless the server's was derived the same way (`thread_refusal`).
"""
from __future__ import annotations

import os
import sys

# The modules distlab starts through distlab.launchers.entry, each with its start-up options
# (distlab.launchers.process.enter): a rank's parent must be its own launch's agent (same_launch);
# a training or validation rank's job file says what else it imports (job). The launcher agent
# and a called function are children of run_tree, which checks their parent before they start.
ENTRY_MODULES = {
    "distlab.rank.worker": {"job": "training"},
    "distlab.rank.validate_ranks": {"job": "validation"},
    "distlab.tools.collectives": {},
    "distlab.launchers.loopback": {"same_launch": False},
    "distlab.launchers.call": {"same_launch": False},
}
# Variables a library reads when it is imported (the interpreter, the loader, glibc's malloc,
# GNU OpenMP, MKL, OpenBLAS, torch, Hugging Face, CUDA, DeepSpeed): a request whose value differs from the
# server's is refused. Thread counts are set per job (snakemake) and launch (distlab) and applied
# in the copy (THREAD_POOLS); torchrun's TORCHELASTIC_* and TORCH_NCCL_* are read when the agent
# runs and the process group is made. Intel OpenMP's KMP_* (accelerate launch sets KMP_AFFINITY on
# CPU) count only where libiomp5 is loaded (`_iomp_loaded`): torch's pip wheels use GNU libgomp,
# which never reads them.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO_", "TORCH",
                        "PYTORCH_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "DS_")
PER_LAUNCH_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
# The variables each thread pool reads for its count when its library loads, first set wins:
# torch's intra-op pool (ATen's intraop_default_num_threads: MKL_NUM_THREADS over OMP_NUM_THREADS;
# torch.set_num_threads sets its OpenMP and MKL counts), and OpenBLAS (numpy's and scipy's,
# driver/others/openblas_env.c).
THREAD_POOLS = {"torch": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
                "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")}
THREAD_VARIABLES = tuple(sorted({name for names in THREAD_POOLS.values() for name in names}))
NAMESPACES = ("net", "mnt", "pid", "user", "cgroup")
# The request a stand-in sends (distlab.launchers.warm_start._request): field -> (type, item type).
REQUEST_FIELDS = {"module": (str, None), "argv": (list, str), "cwd": (str, None), "env": (dict, str),
                  "umask": (int, None), "affinity": (list, int), "started": ((int, float), None),
                  "executable": (str, None), "imports": (list, str), "distlab": (str, None),
                  "hash_seed": (str, None)}

# The server's state as it started, before its imports (what it is compared on).
environ_before_imports: dict[str, str] = {}
environ_added: dict[str, str] = {}  # what its imports set (torch: TORCHINDUCTOR_CACHE_DIR)
context_before_imports: dict[str, str] = {}
hash_seed_of_server: list[str] = []


def record_server_start() -> None:
    """Called first thing by the server: what its requests are compared against."""
    from distlab.launchers.warm_start import hash_seed

    environ_before_imports.update(os.environ)
    context_before_imports.update(process_context("self"))
    hash_seed_of_server[:] = [hash_seed()]


def _iomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as fh:
            return "libiomp" in fh.read()
    except OSError:
        return False


def shape_error(request) -> str | None:
    """Why a request is not one a stand-in sends (None: it is): checked before anything reads it."""
    if not isinstance(request, dict):
        return f"a request is a JSON object, not {type(request).__name__}"
    for field, (kind, item) in REQUEST_FIELDS.items():
        if field not in request:
            return f"request field '{field}' is missing"
        value = request[field]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"request field '{field}' is {type(value).__name__}, not {getattr(kind, '__name__', 'a number')}"
        values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        keys = value.keys() if isinstance(value, dict) else ()
        if item is not None and not all(isinstance(v, item) and not isinstance(v, bool) for v in [*values, *keys]):
            return f"request field '{field}' holds an item that is not {item.__name__}"
    return None


def refusal(request: dict) -> str | None:
    """Why this server must not run the request (None: it may). The request's shape is checked
    (shape_error) before this reads it."""
    if request["module"] not in ENTRY_MODULES:
        return f"{request['module']} is not an entry module distlab starts"
    from distlab.launchers.warm_start import flavours

    if not set(request["imports"]) <= set(flavours()):
        return f"no flavour server imports {sorted(set(request['imports']) - set(flavours()))}"
    if request["executable"] != sys.executable:
        return f"another Python ({request['executable']}, the server runs {sys.executable})"
    import distlab

    here = os.path.dirname(os.path.abspath(distlab.__file__))
    if request["distlab"] != here:
        return f"another distlab checkout ({request['distlab']}, the server imported {here})"
    ours_seed = hash_seed_of_server[0] if hash_seed_of_server else None
    if ours_seed is not None and request["hash_seed"] != ours_seed:
        return (f"hash seed {request['hash_seed']} (the server's is {ours_seed}): a forked interpreter "
                "cannot change its hash seed")
    prefixes = IMPORT_TIME_PREFIXES + (("KMP_",) if _iomp_loaded() else ())
    theirs, ours = request["env"], environ_before_imports
    for name in sorted(set(theirs) | set(ours)):
        if (name.startswith(prefixes) and name not in THREAD_VARIABLES and name != "PYTHONHASHSEED"
                and not name.startswith(PER_LAUNCH_PREFIXES) and theirs.get(name) != ours.get(name)
                and not (name in environ_added and theirs.get(name) == environ_added[name])):  # an import set it
            return f"{name} differs ({theirs.get(name)!r}; the server imported under {ours.get(name)!r})"
    return thread_refusal(request["env"], request["affinity"])


# -- the process context --------------------------------------------------------------------------
def process_context(pid: int | str) -> dict[str, str]:
    """What a fork inherits from the kernel and cannot change: namespaces, cgroup, resource
    limits (each as /proc/<pid> shows it). Raises OSError when the process is gone."""
    context = {f"{name} namespace": os.readlink(f"/proc/{pid}/ns/{name}") for name in NAMESPACES}
    with open(f"/proc/{pid}/cgroup") as fh:
        context["cgroup"] = fh.read().strip()
    with open(f"/proc/{pid}/limits") as fh:
        for line in fh.read().splitlines()[1:]:  # "Max open files  20000  20000  files"
            context[f"limit '{line[:26].strip()}'"] = " ".join(line[26:].split())
    return context


def context_refusal(pid: int) -> str | None:
    """Why a copy forked here would not be the process `pid` is (None: it would be): the
    server's namespaces and cgroup now (a copy is forked into them), its limits as it started
    (an import that changed them would change a fresh process's too)."""
    if pid <= 0:
        return "the stand-in's pid cannot be seen from the server (another pid namespace)"
    try:
        theirs = process_context(pid)
        here = process_context("self")
    except OSError as exc:
        return f"the stand-in's /proc/{pid} cannot be read ({exc.strerror or exc}): it is gone"
    ours = {**context_before_imports, **{k: v for k, v in here.items() if not k.startswith("limit ")}}
    for what in theirs:
        if theirs[what] != ours.get(what):
            return f"{what} differs ({theirs[what]!r}; the server's is {ours.get(what)!r})"
    return None


# -- thread settings -------------------------------------------------------------------------------
def _count(env: dict, pool: str) -> int | None:
    """The thread count a fresh `pool` would read from env (None: it derives one from the CPUs)."""
    for name in THREAD_POOLS[pool]:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def thread_refusal(env: dict, affinity: list[int]) -> str | None:
    """A pool whose count a fresh process would derive from the machine (no variable set) keeps
    the server's, which is that count only where the server derived its own the same way."""
    for pool in THREAD_POOLS:
        if _count(env, pool) is None and (_count(environ_before_imports, pool) is not None
                                          or sorted(affinity) != sorted(os.sched_getaffinity(0))):
            return (f"no {'/'.join(THREAD_POOLS[pool])} set: a fresh {pool} would count the CPUs itself, "
                    "which a fork of the server cannot redo")
    return None


def apply_thread_settings(env: dict) -> None:
    """In a copy: each thread pool the server loaded, set as a fresh process would have set it
    from env (what thread_refusal let through always names a count or matches the server's)."""
    count = _count(env, "torch")
    if count is not None and "torch" in sys.modules:
        import torch

        torch.set_num_threads(count)
    count = _count(env, "openblas")
    if count is not None:
        from threadpoolctl import ThreadpoolController

        # OpenBLAS caps what it reads at the CPUs it may use (get_num_procs).
        ThreadpoolController().select(internal_api="openblas").limit(
            limits=min(count, len(os.sched_getaffinity(0))))
