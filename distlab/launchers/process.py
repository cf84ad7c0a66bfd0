"""Starting a launcher process and waiting for it: the one place processes are handled.

No process distlab starts may outlive its job. Two mechanisms, because each covers what
the other cannot:
- PR_SET_PDEATHSIG: every process in the chain (the Snakemake script, the launcher
  torchrun / accelerate launch / Ray driver, each rank) asks the kernel for SIGKILL when its
  parent dies. A SIGKILLed snakemake then takes its whole job tree down level by level,
  although nobody is left to clean up. torchrun starts every rank in its own session, so
  killing torchrun's process group alone never reached the ranks.
- On a timeout, an error or an interrupt in the waiting process, the launcher's whole
  process tree (psutil, recursive) is killed, and afterwards any process that carries this
  launch's identity.
Identity is exact, never a substring of a command line (an unrelated `tail -f .../job.json`
must neither block a launch nor be killed with it): every process a launch starts inherits
DISTLAB_LAUNCH=<run key>-<launch id>, the run key a hash of the job file's absolute path.
Before a launch, `refuse_if_running` finds processes of an earlier launch of the same run
still alive (a SIGKILLed run on a machine without PR_SET_PDEATHSIG, a manual start) and
refuses, naming their pids: two sets of ranks must never share a run folder.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil

from distlab.launchers import warm_start

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCH_ENV = warm_start.LAUNCH_ENV


def die_with_parent(parent: int | None = None, parent_names: str | None = None, same_launch: bool = False) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).
    Called first thing in every process distlab starts. The parent may already have died
    (a rank spends seconds importing torch first): `parent` is the pid it must have,
    `same_launch` says it must carry this process's own launch identity (a rank's launcher),
    `parent_names` a string its command line must contain (the Snakemake that runs a rule's
    script); otherwise this process exits at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if warm_start.in_copy():
        return  # a warm copy's parent is the server; its stand-in passed these checks and holds its life
    if parent is not None and os.getppid() != parent:
        os._exit(1)
    if same_launch or parent_names is not None:
        try:
            above = psutil.Process(os.getppid())
            orphaned = (launch_of(above) != os.environ.get(LAUNCH_ENV) if same_launch else
                        not any(parent_names in part for part in above.cmdline()))
        except psutil.Error:
            orphaned = True
        if orphaned:
            wanted = f"launch {os.environ.get(LAUNCH_ENV)}" if same_launch else f"naming {parent_names}"
            print(f"parent process is gone (no process of {wanted} above pid {os.getpid()}); exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)


def enter(module: str, same_launch: bool = True, job: str | None = None) -> None:
    """What distlab.launchers.entry runs before an entry module's heavy imports (every process
    distlab starts that a warm start may fork: `python -m distlab.launchers.entry <module>`): the
    parent check (die_with_parent; same_launch: the module is a rank, whose parent is its
    launch's agent), then a warm start where this run offers one
    (distlab.launchers.warm_start.hand_over: this process then ends with its forked copy).
    job: "training" or "validation" for a rank of a --job file (what else it imports follows
    from its spec: warm_start.rank_imports)."""
    if same_launch:
        die_with_parent(same_launch=True)
    imports = warm_start.job_rank_imports(training=job == "training") if job else []
    warm_start.hand_over(module, imports)


def exit_without_teardown(code: int = 0) -> None:
    """End a process whose work is done (a rank, a launcher agent) at once: its output flushed,
    without the interpreter's teardown. Freeing torch's, transformers' and peft's module graphs
    one object at a time cost a rank about 1.3 s of CPU here (user time of a process that
    imported them: 5.0 s exiting normally, 3.7 s with os._exit), paid by every rank of every
    launch; the OS frees the same memory at once. Every file distlab writes is closed by then
    (trackers close their writers in Trackers.finish)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_key(job_path: str) -> str:
    """What every launch of one run folder shares: a hash of its job file's absolute path."""
    return hashlib.sha256(os.path.abspath(job_path).encode()).hexdigest()[:16]


def new_launch_identity(job_path: str) -> str:
    return f"{run_key(job_path)}-{uuid.uuid4().hex[:12]}"


def launch_of(proc: psutil.Process) -> str | None:
    """The DISTLAB_LAUNCH identity a process was started with (None: none, or not readable).
    Only this user's processes have one: anybody may set the variable on a process of their own,
    and distlab running as root would otherwise let any local user block its launches
    (refuse_if_running) or see their process counted as a rank (kill_tree). A process of this
    user could do worse than that to this one anyway."""
    try:
        uids = proc.uids()
        if uids.real != os.getuid() or uids.effective != os.getuid():
            return None
        return proc.environ().get(LAUNCH_ENV) or warm_start.launch_of_copy(proc.pid, proc.cmdline(), proc.ppid())
    except (psutil.Error, OSError):
        return None


def processes_of(identity: str) -> list[psutil.Process]:
    """Live processes (not this one) of a launch (identity `<key>-<id>`) or of any launch of a
    run (identity `<key>`), matched exactly on DISTLAB_LAUNCH."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == os.getpid():
            continue
        value = launch_of(proc)
        if value is not None and (value == identity or value.split("-")[0] == identity):
            found.append(proc)
    return found


def refuse_if_running(job_path: str, what: str) -> None:
    """Raise when processes of an earlier launch of this run (its job file) still run."""
    alive = processes_of(run_key(job_path))
    if alive:
        lines = []
        for proc in alive:
            try:
                lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            except psutil.NoSuchProcess:
                continue
        if lines:
            pids = " ".join(line.split()[1].rstrip(":") for line in lines)
            raise RuntimeError(f"{what}: processes of an earlier launch still run on {job_path}; two sets of "
                               f"ranks must not share a run folder. Stop them first (kill {pids}):\n"
                               + "\n".join(lines))


def kill_tree(proc: psutil.Process | None, identity: str | None = None) -> list[int]:
    """SIGKILL a process and all its descendants (each rank sits in its own session, so a
    process group does not reach them), then any process still carrying launch `identity`."""
    victims = []
    if proc is not None:
        try:
            victims = [proc] + proc.children(recursive=True)
        except psutil.NoSuchProcess:
            victims = []
    if identity:
        victims += [p for p in processes_of(identity) if p.pid not in {v.pid for v in victims}]
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 10
    while any(_running(v) for v in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [v.pid for v in victims]


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it, not for us)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Terminated(Exception):
    """SIGTERM reached the waiting process (Snakemake cancelling the job)."""


def _raise_terminated(signum, frame):
    raise _Terminated(f"received signal {signum}")


def run_tree(cmd: list[str], env: dict, stdout, timeout: float | None, marker: str | None = None) -> int | None:
    """Run cmd to completion and return its exit status, or None when it was killed at the
    timeout. However this returns or raises, no process of its tree is left running.
    marker: the job file; the launch's processes carry an identity derived from it."""
    parent = os.getpid()
    identity = new_launch_identity(marker) if marker else None
    if identity:
        env = dict(env, **{LAUNCH_ENV: identity})
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if is_main else None
    # Own session (a terminal's Ctrl-C reaches this process, which then kills the tree);
    # PR_SET_PDEATHSIG set in the child before it runs the launcher.
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                            preexec_fn=lambda: die_with_parent(parent), start_new_session=True)
    handle = psutil.Process(proc.pid)
    try:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    finally:
        kill_tree(handle if proc.poll() is None else None, identity)
        proc.wait()
        if is_main:
            signal.signal(signal.SIGTERM, previous)


def launch_line(cmd: list[str]) -> str:
    """The `$ ...` line a log gets for a command distlab starts: with the paths of this checkout,
    the working folder and the home folder written relative to them (distlab.records.sharing)."""
    from distlab.records.sharing import portable

    return "$ " + portable(" ".join(cmd)) + "\n"


def run_ranks(cmd: list[str], env: dict, log_path: str | None, timeout: float | None,
              marker: str | None = None, what: str = "training ranks", check: bool = True) -> int | None:
    """Run a launcher (torchrun, accelerate launch, a Ray driver) to completion; the `$ ...`
    line that starts it and its output go to log_path (None: this process's stdout). check: a
    non-zero exit or the timeout raises with the log's last lines, naming `what` ran; else the
    status is returned (None: killed at the timeout, which the log says)."""
    log = open(log_path, "a") if log_path else None
    try:
        print(launch_line(cmd), end="", file=log or sys.stdout, flush=True)
        status = run_tree(cmd, env, log, timeout, marker)
        if status is None and not check:
            print(f"{what} killed after the {timeout} s timeout", file=log or sys.stdout, flush=True)
    finally:
        if log:
            log.close()
    if status != 0 and check:
        raise launch_failure(status, timeout, log_path, what)
    return status


def launch_failure(status: int | None, timeout: float | None, log_path: str | None,
                   what: str = "training ranks") -> RuntimeError:
    """The error of a launch that ended with `status` (None: killed at the timeout)."""
    tail = ""
    if log_path:
        tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-40:])
    how = f"were killed with their launcher after the {timeout} s timeout" if status is None else \
        f"exited with status {status}"
    return RuntimeError(f"{what} {how}; last log lines:\n{tail}")


def run_trees(cmds: list[list[str]], env: dict, stdout, timeout: float | None, marker: str | None = None) -> int | None:
    """run_tree for several launchers that make one job (one torchrun agent per host of a
    link, distlab.launchers.linked): all run at once; the first to fail, the timeout or a
    signal ends them all. Returns 0, the first non-zero status, or None at the timeout."""
    parent = os.getpid()
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if is_main else None
    procs, handles = [], []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                                          preexec_fn=lambda: die_with_parent(parent), start_new_session=True))
            handles.append(psutil.Process(procs[-1].pid))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.1)
    finally:
        for proc, handle in zip(procs, handles):
            kill_tree(handle if proc.poll() is None else None)
        kill_tree(None, marker)
        for proc in procs:
            proc.wait()
        if is_main:
            signal.signal(signal.SIGTERM, previous)
