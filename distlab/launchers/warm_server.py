"""The warm-start server (distlab.launchers.warm_start says why and how): one per snakemake run,
`python -m distlab.launchers.warm_server serve <folder> <snakemake pid>`.

It binds <folder>/socket before importing (requests wait in the backlog), imports PRELOAD, then
serves: for each request it checks its shape, the request and the stand-in's process context
(distlab.launchers.warm_checks), forks a copy that becomes the stand-in's process
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

from distlab.launchers import warm_checks, warm_start
from distlab.launchers.warm_start import LAUNCH_ENV, send_message

# What every CPU training rank imports anyway: torch, distlab's rank code, transformers' model base
# (its import is ~2.7 s of CPU), transformers' schedulers (~2 s: transformers 5 pulls in PEFT and
# bitsandbytes through them) and datasets (the prepared blocks, ~0.4 s); besides, for the agents,
# torchrun's launcher API (~0.1 s of import), and the default model's family (a rank of another
# family imports its own on top). tests/test_warm_start.py checks a fresh rank imports each.
PRELOAD = ("torch", "torch.distributed.launcher.api", "distlab.runtime.worker", "distlab.runtime.validate_ranks",
           "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "transformers.optimization", "datasets")

_flavour: tuple[str, ...] = ()  # what this server imported beyond PRELOAD


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
    warm_checks.record_server_start()
    _die_with_parent()  # the server ends with the snakemake that started it
    if os.getppid() != parent:
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, "socket"))
    listener.listen(64)  # requests wait here while PRELOAD imports
    os.makedirs(os.path.join(folder, "copies"), exist_ok=True)
    _import(PRELOAD)
    warm_checks.environ_added.update({name: value for name, value in os.environ.items()
                                      if name not in warm_checks.environ_before_imports})
    print(f"warm start server {os.getpid()}: imported {', '.join(PRELOAD)}", flush=True)
    # Flavour servers start on a rank's first request for one, not ahead: started with the base
    # server they competed with the run's data preparation (the default run took as long,
    # 6:04 against 6:00) and a small run asks for few of them.
    _serve(listener, folder, selectors.DefaultSelector(), {})


def _serve(listener: socket.socket, folder: str, selector, flavours: dict[tuple[str, ...], str]) -> None:
    """flavours: the base server's, flavour -> its socket (a flavour server's is empty).
    Each event is handled inside its own error boundary: one bad request, or a stand-in gone
    before its reply, costs that request only (every copy dies with its server)."""
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    copies: dict[int, tuple[socket.socket, int]] = {}
    while True:
        for key, _ in selector.select():
            kind, pid = key.data
            try:
                if kind == "accept":
                    _accept(listener, folder, selector, flavours, copies)
                elif kind == "stand-in":  # the stand-in went away (killed): its copy goes too
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    selector.unregister(copies[pid][0])
                else:  # the copy ended: tell its stand-in how
                    _reap(pid, copies, selector, folder)
            except Exception as error:  # noqa: BLE001 - logged; the server serves on
                import traceback

                print(f"warm start server {os.getpid()}: dropped a failed {kind} event, serving on: {error!r}\n"
                      f"{traceback.format_exc()}", flush=True)


def _accept(listener, folder: str, selector, flavours: dict, copies: dict) -> None:
    """One request: refused, redirected to a flavour server, or served by a forked copy (then
    its connection stays open until the copy ends; otherwise it closes here, whatever failed)."""
    conn, _ = listener.accept()
    fds, copy = [], None
    try:
        request, fds, peer = _read_request(conn)
        if request is None:
            return
        why = warm_checks.shape_error(request)
        wanted = tuple(sorted(request["imports"])) if why is None else ()
        why = why or warm_checks.refusal(request) or warm_checks.context_refusal(peer)
        if why is None and wanted != _flavour:
            if _flavour:
                why = f"this flavour server imported {_flavour}, not {wanted}"
            else:
                if wanted not in flavours:
                    flavours[wanted] = _start_flavour(wanted, folder, len(flavours), listener, selector,
                                                      copies, [conn.fileno(), *fds])
                send_message(conn, {"redirect": flavours[wanted]})
                return
        if why is not None:
            print(f"warm start server {os.getpid()}: refused pid {peer}: {why}", flush=True)
            send_message(conn, {"refused": why})
            return
        copy = _fork_copy(request, fds, conn, folder, listener, selector, copies)
    finally:
        for fd in fds:  # the copy has its own; the server never needs them
            os.close(fd)
        if copy is None:
            conn.close()
    pid, pidfd = copy
    copies[pid] = (conn, pidfd)
    selector.register(pidfd, selectors.EVENT_READ, ("exited", pid))
    selector.register(conn, selectors.EVENT_READ, ("stand-in", pid))


def _read_request(conn: socket.socket) -> tuple[dict | None, list[int], int]:
    """The stand-in's request, the stdio it sent and its pid (SO_PEERCRED; 0 where the server
    cannot see it). None for another user's connection or a broken message."""
    conn.settimeout(10)
    peer, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return None, [], peer
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
        return None, [], peer
    conn.settimeout(None)
    return request, fds, peer


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
    record = os.path.join(folder, "copies", str(pid))
    try:
        with open(record, "w") as fh:
            fh.write(request["env"].get(LAUNCH_ENV, ""))
        send_message(conn, {"pid": pid})
        return pid, os.pidfd_open(pid)
    except BaseException:  # the stand-in is gone (BrokenPipeError, ConnectionResetError): no copy without it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(f"warm start server {os.getpid()}: copy {pid} killed, its stand-in could not be told", flush=True)
        try:
            os.unlink(record)
        except FileNotFoundError:
            pass
        raise


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
        os.environ.update({**warm_checks.environ_added, **request["env"]})
        sys.argv = list(request["argv"])
        sys.path[0] = request["cwd"]  # what `python -m` puts first
        try:
            with open("/proc/self/clear_refs", "w") as fh:  # the memory high-water mark starts here
                fh.write("5")
        except OSError:
            pass
        warm_checks.apply_thread_settings(request["env"])
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
