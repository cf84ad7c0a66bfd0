"""The warm-start server (distlab.launchers.warm_start says why and how): one per snakemake run,
`python -m distlab.launchers.warm_server serve <folder> <snakemake pid>`.

It binds <folder>/socket before importing (requests wait in the backlog), imports PRELOAD, then
serves: for each request it checks `refusal`, forks a copy that becomes the stand-in's process
(`_become`), records the copy's launch identity in <folder>/copies/<pid>, and tells the
stand-in how the copy ended when it reaps it. A request that imports more (MLflow, DeepSpeed,
Accelerate, PEFT: warm_start.rank_imports) is redirected to a flavour server: a fork of this one
that imported them too, started on the first such request and kept for the run.
Single-threaded on purpose (selectors over the sockets and each copy's pidfd): a process that
forks must hold no other thread.
"""
from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

from distlab.launchers import warm_start
from distlab.launchers.warm_start import LAUNCH_ENV, send_message

ENTRY_MODULES = ("distlab.runtime.worker", "distlab.runtime.validate_ranks", "distlab.launchers.loopback",
                 "distlab.tools.collectives")
# What every CPU rank imports anyway: torch, distlab's rank code, transformers' model base (its
# import is ~2.7 s of CPU); besides, for the agents, torchrun's launcher API (~0.1 s of import),
# and the default model's family (a rank of another family imports its own on top).
PRELOAD = ("torch", "torch.distributed.launcher.api", "distlab.runtime.worker", "distlab.runtime.validate_ranks",
           "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama")
# A flavour server's extra imports may be only these (what rank_imports names).
FLAVOURS = ("deepspeed", "accelerate", "peft", "mlflow")
# Variables a library reads when it is imported (the interpreter, the loader, glibc's malloc,
# GNU OpenMP, MKL, torch, Hugging Face, CUDA, DeepSpeed): a request whose value differs from the
# server's is refused. Thread counts are set per job (snakemake) and launch (distlab) and applied
# in the copy (torch.set_num_threads sets OpenMP's and MKL's); torchrun's TORCHELASTIC_* and
# TORCH_NCCL_* are read when the agent runs and the process group is made. Intel OpenMP's KMP_*
# (accelerate launch sets KMP_AFFINITY on CPU) count only where libiomp5 is loaded (`_iomp_loaded`):
# torch's pip wheels use GNU libgomp, which never reads them.
IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "MKL_", "TORCH", "PYTORCH_", "HF_",
                        "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "DS_")
PER_LAUNCH = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
PER_LAUNCH_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")

_environ_before_imports: dict[str, str] = {}  # this server's environment as it started (compared on)
_environ_added: dict[str, str] = {}  # what its imports set (torch: TORCHINDUCTOR_CACHE_DIR)
_flavour: tuple[str, ...] = ()  # what this server imported beyond PRELOAD


def _iomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as fh:
            return "libiomp" in fh.read()
    except OSError:
        return False


def refusal(request: dict) -> str | None:
    """Why this server must not run the request (None: it may)."""
    if request["module"] not in ENTRY_MODULES:
        return f"{request['module']} is not an entry module distlab starts"
    if not set(request.get("imports", [])) <= set(FLAVOURS):
        return f"no flavour server imports {sorted(set(request['imports']) - set(FLAVOURS))}"
    if request["executable"] != sys.executable:
        return f"another Python ({request['executable']}, the server runs {sys.executable})"
    import distlab

    here = os.path.dirname(os.path.abspath(distlab.__file__))
    if request["distlab"] != here:
        return f"another distlab checkout ({request['distlab']}, the server imported {here})"
    prefixes = IMPORT_TIME_PREFIXES + (("KMP_",) if _iomp_loaded() else ())
    theirs, ours = request["env"], _environ_before_imports
    for name in sorted(set(theirs) | set(ours)):
        if (name.startswith(prefixes) and name not in PER_LAUNCH and not name.startswith(PER_LAUNCH_PREFIXES)
                and theirs.get(name) != ours.get(name)
                and not (name in _environ_added and theirs.get(name) == _environ_added[name])):  # an import set it
            return f"{name} differs ({theirs.get(name)!r}; the server imported under {ours.get(name)!r})"
    return None


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (the kernel half of
    distlab.launchers.process.die_with_parent, which imports warm_start)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _import(names) -> None:
    """Import `names`; DeepSpeed's optional `import mlflow` stays out unless MLflow is asked for
    (distlab.runtime.tracking.hide_mlflow: a rank that writes no MLflow run never maps it)."""
    hidden = "mlflow" not in names and "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None
    try:
        for name in names:
            importlib.import_module(name)
        if "mlflow" in names:  # the tracking store's ORM mappers, set up once (~0.6 s of CPU a run)
            importlib.import_module("mlflow.store.tracking.sqlalchemy_store")
            from sqlalchemy.orm import configure_mappers

            configure_mappers()
    finally:
        if hidden:
            del sys.modules["mlflow"]


def serve(folder: str, parent: int) -> None:
    _environ_before_imports.update(os.environ)
    _die_with_parent()  # the server ends with the snakemake that started it
    if os.getppid() != parent:
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, "socket"))
    listener.listen(64)  # requests wait here while PRELOAD imports
    os.makedirs(os.path.join(folder, "copies"), exist_ok=True)
    _import(PRELOAD)
    _environ_added.update({name: value for name, value in os.environ.items() if name not in _environ_before_imports})
    print(f"warm start server {os.getpid()}: imported {', '.join(PRELOAD)}", flush=True)
    # Flavour servers start on a rank's first request for one, not ahead: started with the base
    # server they competed with the run's data preparation (the default run took as long,
    # 6:04 against 6:00) and a small run asks for few of them.
    _serve(listener, folder, selectors.DefaultSelector(), {})


def _serve(listener: socket.socket, folder: str, selector, flavours: dict[tuple[str, ...], str]) -> None:
    """flavours: the base server's, flavour -> its socket (a flavour server's is empty)."""
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    copies: dict[int, tuple[socket.socket, int]] = {}
    while True:
        for key, _ in selector.select():
            kind, pid = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                request, fds = _read_request(conn)
                if request is None:
                    conn.close()
                    continue
                wanted = tuple(sorted(request.get("imports", [])))
                why = refusal(request)
                if why is None and wanted != _flavour:
                    if _flavour:
                        why = f"this flavour server imported {_flavour}, not {wanted}"
                    else:
                        if wanted not in flavours:
                            flavours[wanted] = _start_flavour(wanted, folder, len(flavours), listener, selector,
                                                              copies, [conn.fileno(), *fds])
                        send_message(conn, {"redirect": flavours[wanted]})
                if why is not None:
                    send_message(conn, {"refused": why})
                if why is not None or wanted != _flavour:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid, pidfd = _fork_copy(request, fds, conn, folder, listener, selector, copies)
                copies[pid] = (conn, pidfd)
                selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                selector.register(conn, selectors.EVENT_READ, ("stand-in", pid))
            elif kind == "stand-in":  # the stand-in went away (killed): its copy goes too
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(copies[pid][0])
            else:  # the copy ended: tell its stand-in how
                _reap(pid, copies, selector, folder)


def _read_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    conn.settimeout(10)
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():
        return None, []
    fds = []
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        size = struct.unpack("!I", msg[:4])[0]
        body = msg[4:]
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("the stand-in closed its request")
            body += chunk
        request = json.loads(body)
    except (OSError, ValueError, struct.error):
        for fd in fds:
            os.close(fd)
        return None, []
    conn.settimeout(None)
    return request, fds


def _start_flavour(wanted: tuple[str, ...], folder: str, index: int, listener, selector, copies,
                   request_fds: list[int]) -> str:
    """Fork a server that imports `wanted` too and serves those requests; returns its socket.
    request_fds: the asking stand-in's connection and stdio, closed in the fork (a pipe's write
    end held by a server would keep its reader from ever seeing the end of the stand-in's output)."""
    path = os.path.join(folder, f"flavour-{index}")
    flavour_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    flavour_listener.bind(path)
    flavour_listener.listen(64)  # requests wait here while it imports
    sys.stdout.flush()
    if os.fork() == 0:
        global _flavour
        try:
            _flavour = wanted
            selector.close()
            listener.close()
            for conn, pidfd in copies.values():
                conn.close()
                os.close(pidfd)
            copies.clear()
            for fd in request_fds:
                os.close(fd)
            _die_with_parent()  # a flavour server ends with the base server
            _import(wanted)
            print(f"warm start flavour server {os.getpid()}: imported {', '.join(wanted)} too", flush=True)
            _serve(flavour_listener, folder, selectors.DefaultSelector(), {})
        finally:
            os._exit(1)
    flavour_listener.close()
    return path


def _reap(pid: int, copies: dict, selector, folder: str) -> None:
    conn, pidfd = copies.pop(pid)
    selector.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    if conn in selector.get_map():
        selector.unregister(conn)
    try:
        send_message(conn, {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status)
                     else {"exit": os.WEXITSTATUS(status)})
    except OSError:
        pass
    conn.close()
    try:
        os.unlink(os.path.join(folder, "copies", str(pid)))
    except FileNotFoundError:
        pass


def _fork_copy(request: dict, fds: list[int], conn, folder: str, listener, selector, copies) -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for other, pidfd in copies.values():
            other.close()
            os.close(pidfd)
        _become(request, fds, conn, listener, selector)  # never returns
    for fd in fds:
        os.close(fd)
    with open(os.path.join(folder, "copies", str(pid)), "w") as fh:
        fh.write(request["env"].get(LAUNCH_ENV, ""))
    send_message(conn, {"pid": pid})
    return pid, os.pidfd_open(pid)


def _become(request: dict, fds: list[int], conn, listener, selector) -> None:
    """In the forked copy: take over the stand-in's state, then run its module as __main__."""
    code = 1
    try:
        warm_start.become_copy(request["started"])
        selector.close()
        listener.close()
        conn.close()  # the server keeps its end: the stand-in's death reaches the copy through it
        os.setsid()
        _die_with_parent()  # and the copy ends with its server
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.sched_setaffinity(0, request["affinity"])
        os.environ.clear()  # the stand-in's environment, and what the server's imports set, as a fresh import would
        os.environ.update({**_environ_added, **request["env"]})
        sys.argv = list(request["argv"])
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        try:
            with open("/proc/self/clear_refs", "w") as fh:  # the memory high-water mark starts here
                fh.write("5")
        except OSError:
            pass
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import runpy

        # As `python -m` runs it: as __main__ only (the preloaded copy under its own name would
        # make runpy warn, and a later import of that name gets a module of its own, as fresh).
        sys.modules.pop(request["module"], None)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a copy reports what killed it, as an interpreter would
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    # The module's own copy, not __main__'s: the server's state lives where distlab imports it.
    from distlab.launchers import warm_server

    warm_server.serve(sys.argv[2], int(sys.argv[3]))
