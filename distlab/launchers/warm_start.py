"""Warm starts: CPU ranks and their torchrun agents forked from an interpreter that imported
torch and transformers once for the whole Snakemake run, instead of each importing them.

Why: on a laptop a short experiment is mostly fixed costs. Every rank process imported torch
(~1.3 s of CPU), transformers' model code (~2.7 s), distlab and its strategy's libraries, and
every launch's torchrun agent imported torch again: ~4-5 s of CPU per rank, paid ~100 times by
the default run on 2 cores.

How (the pattern of multiprocessing's forkserver and Android's zygote):
- `snakemake` starts one server per run (`start_server`, from the Snakefile's onstart;
  distlab.launchers.warm_server). It imports PRELOAD and waits; for a rank that also imports
  MLflow, DeepSpeed, Accelerate or PEFT (`rank_imports`) it forks a flavour server that imports
  them too, on the first such request, and keeps it for the run. Servers start no thread and never
  touch a GPU, so forking them is safe.
- The launcher starts its agent and ranks exactly as before, each through one prefix
  (`python -m distlab.launchers.entry <entry module> ...`, distlab.launchers.entry; the lines in
  the log rerun by hand). Before the module's imports the prefix runs
  distlab.launchers.process.enter: with SOCKET_ENV in its environment (CPU launches only:
  distlab.launchers.environment) the process sends the server its module, argv, environment,
  working folder, umask, CPU affinity and its stdin/stdout/stderr (SCM_RIGHTS), and stays as the
  stand-in of the forked copy: it forwards the signals it gets and exits with the copy's status
  (or by its signal). The server kills the copy if the stand-in dies (its socket closes), and a
  copy dies with its server.
- The copy takes over the stand-in's state, resets the memory high-water mark (so the rank's
  peaks and its memory budget count its own life, distlab.runtime.memory) and runs the module as
  `__main__`. Its process clock starts at the fork: the timeline's origin is the stand-in's start
  (`process_started`), and rank 0's timeline says how the rank started (`start_record`).
- Memory: a copy maps the server's imported modules as a fresh rank maps its own (the server
  imports nothing the rank would not), but only the pages it touches count in its RSS: warm
  ranks of the default run measured 60-100 MB less RSS than fresh ones (pages only the import
  touched). The budget and the peaks are this process's, as measured.
- A process's launch identity (distlab.launchers.process) is read from /proc/<pid>/environ, which
  a fork keeps from the server: the server records each copy's DISTLAB_LAUNCH in its folder
  (`launch_of_copy`), so refuse_if_running and kill_tree see warm ranks as they see fresh ones.

Refused (the process then starts as before, and says why on stderr and in the timeline): no
server, another distlab checkout or Python, another hash seed, an environment variable read
while a library is imported that differs from the server's, or another process context
(namespaces, cgroup, resource limits; distlab.launchers.warm_checks): a warm rank must be the
process a fresh start would have been. A rank in a link's host namespace is never offered one.
The run's server and its folder belong to the run that started it (`start_run_server`): the stop
hooks remove only the files it made, and the next start removes what dead servers left.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import sys

from distlab.records.spec import Spec

SOCKET_ENV = "DISTLAB_WARM_SOCKET"
REFUSED_ENV = "DISTLAB_WARM_REFUSED"  # why a process with a server started fresh
SERVER_MODULE = "distlab.launchers.warm_server"
REPLY_TIMEOUT_S = 120  # the server's imports take ~5 s here; a slow laptop's, a few times that
LAUNCH_ENV = "DISTLAB_LAUNCH"  # distlab.launchers.process.LAUNCH_ENV (imported there from here)

_in_copy = False  # True in a forked copy: its entry module runs, it does not hand over again
_started: float | None = None  # a copy's stand-in's start (a copy's process clock starts at the fork)


# -- the stand-in ----------------------------------------------------------------------------------
def hand_over(module: str, imports: list[str]) -> None:
    """Run the rest of this process in a warm copy when a server is offered; return otherwise
    (a fresh start). imports: what this process imports beyond PRELOAD (rank_imports).
    Called by distlab.launchers.process.enter, after the entry's parent check."""
    path = os.environ.get(SOCKET_ENV)
    if _in_copy or not path:
        return
    reply, sock = _request(path, module, imports)
    if "redirect" in reply:  # the flavour server that imported `imports` too
        sock.close()
        reply, sock = _request(reply["redirect"], module, imports)
    if "pid" not in reply:
        if sock is not None:
            sock.close()
        os.environ[REFUSED_ENV] = reply["refused"]
        print(f"distlab warm start refused, starting fresh: {reply['refused']}", file=sys.stderr, flush=True)
        return
    copy = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(copy, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    status = read_message(sock)  # the server's word when the copy ends (it reaps it)
    sys.stdout.flush()
    if status is None:
        print("distlab warm start: the server went away before the copy ended", file=sys.stderr, flush=True)
        os._exit(1)
    if "signal" in status:  # end as the copy ended
        if status["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status["exit"])


def _request(path: str, module: str, imports: list[str]) -> tuple[dict, socket.socket | None]:
    import psutil

    import distlab

    started = psutil.Process().create_time()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
    except OSError as exc:
        return {"refused": f"no server at {path} ({exc.strerror or exc})"}, None
    umask = os.umask(0)
    os.umask(umask)
    request = {"module": module, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask,
               "affinity": sorted(os.sched_getaffinity(0)), "started": started, "executable": sys.executable,
               "imports": sorted(imports), "distlab": os.path.dirname(os.path.abspath(distlab.__file__)),
               "hash_seed": hash_seed()}
    body = json.dumps(request).encode()
    # A server still importing keeps the request in its backlog; one that never answers (stuck,
    # or gone after accepting) must not hang the rank: it starts fresh instead. A copy the server
    # forks after that finds its stand-in gone and is killed (warm_server).
    sock.settimeout(REPLY_TIMEOUT_S)
    try:
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        reply = read_message(sock)
    except TimeoutError:
        sock.close()
        return {"refused": f"the server did not answer in {REPLY_TIMEOUT_S} s"}, None
    except OSError as exc:
        sock.close()
        return {"refused": f"the server's socket failed ({exc.strerror or exc})"}, None
    sock.settimeout(None)  # the copy's status comes when it ends, however long it trains
    return (reply if reply is not None else {"refused": "the server closed the connection"}), sock


def hash_seed() -> str:
    """This interpreter's hash seed as it was drawn at start: PYTHONHASHSEED's number, or "random"
    (a seed of its own; a warm copy has its server's, one per run)."""
    value = "" if sys.flags.ignore_environment else os.environ.get("PYTHONHASHSEED", "")
    return value if value.isdigit() else "random"


def read_message(sock: socket.socket) -> dict | None:
    """One length-prefixed JSON message; None at end of stream."""
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    body = _read_exactly(sock, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def send_message(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(body)) + body)


# -- what a copy and the timeline ask ---------------------------------------------------------------
def in_copy() -> bool:
    return _in_copy


def become_copy(started: float) -> None:
    """Called by the server in a forked copy, before it runs the stand-in's module."""
    global _in_copy, _started
    _in_copy, _started = True, started


def process_started() -> float:
    """When this process started, as a user sees it: a copy's stand-in's start."""
    if _in_copy:
        return _started
    import psutil

    return psutil.Process().create_time()


def start_record() -> str:
    """How this process started, for its timeline."""
    if _in_copy:
        return "forked from the run's warm interpreter (distlab.launchers.warm_start)"
    refused = os.environ.get(REFUSED_ENV)
    return f"fresh interpreter (warm start refused: {refused})" if refused else "fresh interpreter"


def launch_of_copy(pid: int, cmdline: list[str], parent: int) -> str | None:
    """A copy's launch identity, recorded by its server (a fork keeps the server's environ): read
    only from a server folder of this user (start_server's name and owner) whose server, running
    with that folder, is the copy's parent."""
    if len(cmdline) < 5 or cmdline[1:4] != ["-m", SERVER_MODULE, "serve"] or not _server_folder(cmdline[4]):
        return None
    import psutil

    try:
        server = psutil.Process(parent)
        if server.cmdline()[1:5] != cmdline[1:5] or server.uids().real != os.getuid():
            return None
        with open(os.path.join(cmdline[4], "copies", str(pid))) as fh:
            return fh.read() or None
    except (OSError, psutil.Error):
        return None


def rank_imports(spec: Spec, rank: int, training: bool = True) -> list[str]:
    """What a rank of `spec` imports beyond PRELOAD that a flavour server can import once, as its
    strategy's settings, its launcher and its method declare them (`rank_libraries`,
    RANK_LIBRARIES, METHOD_LIBRARIES), plus MLflow on a training rank 0 that tracks to it
    (distlab.runtime.tracking.hide_mlflow keeps it out of the others). Each is imported by a fresh
    rank of such a spec (tests/test_warm_start.py checks it)."""
    from distlab.configuration.axes import METHOD_LIBRARIES, RANK_LIBRARIES
    from distlab.configuration.strategies.settings import registered

    imports = [*registered()[spec.strategy].rank_libraries, *RANK_LIBRARIES.get(spec.launcher, ()),
               *METHOD_LIBRARIES.get(spec.method, ())]
    if training and rank == 0 and "mlflow" in spec.tracking:
        imports.append("mlflow")
    return list(dict.fromkeys(imports))


def flavours() -> tuple[str, ...]:
    """Every library a flavour server may import: what any strategy, launcher or method declares,
    and MLflow."""
    from distlab.configuration.axes import METHOD_LIBRARIES, RANK_LIBRARIES
    from distlab.configuration.strategies.settings import registered

    declared = [*(name for s in registered().values() for name in s.rank_libraries),
                *(name for names in RANK_LIBRARIES.values() for name in names),
                *(name for names in METHOD_LIBRARIES.values() for name in names), "mlflow"]
    return tuple(dict.fromkeys(declared))


def job_rank_imports(training: bool = True) -> list[str]:
    """rank_imports of the rank this process is: its job file (--job) and RANK."""
    from distlab.records.spec import Spec

    try:
        path = sys.argv[sys.argv.index("--job") + 1]
        with open(path) as fh:
            spec = Spec(json.load(fh)["spec"])
        return rank_imports(spec, int(os.environ.get("RANK", 0)), training)
    except (ValueError, IndexError, OSError, KeyError):
        return []  # the entry module reports a missing or broken job file itself


# -- the run's server, from the Snakefile ---------------------------------------------------------------
FOLDER_PREFIX = "distlab-warm-"
SERVER_RECORD = "server"  # "<pid> <start time>" of the folder's server, written by start_server
# What a server makes in its folder (with copies/<pid> records): nothing else is ever removed.
SERVER_FILES = re.compile(r"socket|flavour-\d+|" + SERVER_RECORD)
STALE_AFTER_S = 600  # a folder whose start never recorded a server (killed in between) is stale after this

_started_here: list[str] = []  # the socket of the server this process started (the stop hook stops only it)


def start_run_server(wanted: bool, environment: dict, log_path: str) -> str | None:
    """The Snakefile's onstart: an inherited SOCKET_ENV (another run's server) is never offered
    to this run's ranks; when `wanted`, this run's server starts and its socket is offered."""
    os.environ.pop(SOCKET_ENV, None)
    if not wanted:
        return None
    path = start_server(environment, log_path)
    _started_here.append(path)
    os.environ[SOCKET_ENV] = path
    return path


def stop_run_server() -> None:
    """The Snakefile's onsuccess / onerror: stop what start_run_server started, nothing else."""
    while _started_here:
        path = _started_here.pop()
        if os.environ.get(SOCKET_ENV) == path:
            del os.environ[SOCKET_ENV]
        stop_server(path)


def start_server(environment: dict, log_path: str) -> str:
    """Start this run's server (it ends with this process); returns its socket's path. The
    environment is a CPU rank's (distlab.launchers.environment.warm_start_environment). Folders
    of servers that died without their stop hook (a killed snakemake) are removed first."""
    import subprocess
    import tempfile

    import psutil

    remove_stale_folders(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # 0700: only this user reaches the sockets
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, "serve", folder, str(os.getpid())],
                                env=environment, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        started = 0.0
    with open(os.path.join(folder, SERVER_RECORD), "w") as fh:
        fh.write(f"{proc.pid} {started}")
    return os.path.join(folder, "socket")


def _server_folder(folder: str) -> bool:
    """Whether `folder` is one start_server makes: the expected name, a real folder, this user's."""
    import stat

    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return (os.path.basename(folder).startswith(FOLDER_PREFIX) and stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.getuid())


def _server_running(folder: str) -> bool:
    """Whether the server start_server recorded in `folder` still runs (pid and start time)."""
    import psutil

    try:
        pid, started = open(os.path.join(folder, SERVER_RECORD)).read().split()
        return abs(psutil.Process(int(pid)).create_time() - float(started)) < 0.01
    except FileNotFoundError:  # recorded a moment after the folder is made; or a server of before the record
        import time

        return time.time() - os.lstat(folder).st_mtime < STALE_AFTER_S or bool(_servers_of(folder))
    except (OSError, ValueError, psutil.Error):
        return False


def _remove_server_files(folder: str) -> None:
    """Remove what a server made in `folder` (its sockets, its record, its copies' records),
    then the folder if nothing else is in it."""
    copies = os.path.join(folder, "copies")
    for directory, pattern in ((copies, re.compile(r"\d+")), (folder, SERVER_FILES)):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if pattern.fullmatch(name) and not os.path.isdir(os.path.join(directory, name)):
                os.unlink(os.path.join(directory, name))
        if directory == copies:
            _rmdir_if_empty(copies)
    _rmdir_if_empty(folder)


def _rmdir_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:  # not empty (someone else's file), or gone
        pass


def remove_stale_folders(root: str) -> list[str]:
    """The server files of folders under `root` whose server is gone (a killed snakemake never
    ran its stop hook); returns the folders cleaned."""
    cleaned = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if _server_folder(folder) and not _server_running(folder):
            _remove_server_files(folder)
            cleaned.append(folder)
    return cleaned


def _servers_of(folder: str) -> list:
    """This user's server processes of `folder` (a flavour server and a copy carry its command line)."""
    import psutil

    return [proc for proc in psutil.process_iter(["cmdline", "uids"])
            if (proc.info["cmdline"] or [])[1:5] == ["-m", SERVER_MODULE, "serve", folder]
            and proc.info["uids"] and proc.info["uids"].real == os.getuid()]


def stop_server(path: str | None) -> None:
    """End the servers behind `path` (their copies die with them) and remove the files they made
    in their folder; a folder not of start_server's name and owner is left alone."""
    if not path or not _server_folder(os.path.dirname(path)):
        return
    folder = os.path.dirname(path)
    try:
        import psutil

        for proc in _servers_of(folder):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
    finally:
        _remove_server_files(folder)
