"""One workflow at a time per results folder: a lock file inside results_dir itself.

Snakemake's own lock is per working directory (.snakemake/locks), so two clones, `--nolock`
or two machines on one NFS folder with one absolute `results_dir` each get their own; the
second run's Snakemake then deletes the first run's declared outputs before any job of
distlab runs. This lock is taken when the Snakefile loads (before Snakemake can delete a
thing), lives in the results folder (so every clone and host sees it) and is released when
the process exits.

How a holder is known to be alive: it keeps an exclusive flock on the lock file's inode for
its whole life; the kernel (or the NFS lock manager) drops it when the process dies, however
it dies. A lock nobody holds is stale and is replaced on the spot. Where the file system has
no working locks, a lock of this host whose process is gone (pid and start time) is stale; one
of another host is refused, and the message says how to clear it by hand.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import uuid
from pathlib import Path

LOCK_NAME = ".distlab-lock.json"
# Snakemake calls that delete nothing and run no job: they neither take nor need the lock.
READ_ONLY_OPTIONS = {"--dry-run", "--dryrun", "--lint", "--list-rules", "--list", "--list-target-rules", "--lt",
                     "--summary", "--detailed-summary", "--unlock", "--dag", "--rulegraph", "--filegraph",
                     "--d3dag", "--list-changes", "--lc", "--print-compilation", "--list-untracked", "--lu"}
READ_ONLY_DESTS = ("dryrun", "lint", "list_rules", "list_target_rules", "summary", "detailed_summary", "unlock",
                   "dag", "rulegraph", "filegraph", "d3dag", "list_changes", "print_compilation", "list_untracked")

_held: dict[str, "ResultsLock"] = {}


class ResultsFolderBusy(RuntimeError):
    """Another workflow holds the results folder."""


class ResultsLock:
    def __init__(self, path: Path, fd: int, info: dict):
        self.path, self.fd, self.info = path, fd, info

    def release(self) -> None:
        """Remove the lock file if it is still this process's, then drop the flock."""
        try:
            if json.loads(self.path.read_text()).get("token") == self.info["token"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass
        _held.pop(str(self.path), None)


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def holder_text(info: dict) -> str:
    return (f"host {info.get('host')!r}, pid {info.get('pid')}, started {info.get('started')} "
            f"(working directory {info.get('cwd')!r})")


def _read(path: Path) -> dict:
    try:
        info = json.loads(path.read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _flock(fd: int) -> bool | None:
    """Exclusive non-blocking flock: True taken, False held by someone, None no locks here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _stale_without_locks(info: dict) -> bool:
    """No working flock: only a holder of this host can be checked (pid alive, same start)."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    start = _process_start(info["pid"])
    return start is None or abs(start - float(info.get("process_start") or 0)) > 1.0


def acquire(results_dir: str | os.PathLike) -> ResultsLock:
    """Take the results folder's lock or raise ResultsFolderBusy naming its holder."""
    # Absolute now: Snakemake's -d changes the working directory before the exit hook releases it.
    folder = Path(results_dir).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    if str(path) in _held:  # the Snakefile parsed twice in one process
        return _held[str(path)]
    info = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cwd": os.getcwd(), "command": " ".join(sys.argv)[:300], "token": uuid.uuid4().hex}
    tmp = folder / f".distlab-lock.{info['token']}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        has_locks = _flock(fd)  # held before the file can be seen under its name
        os.write(fd, json.dumps(info, indent=1).encode())
        os.fsync(fd)
        try:
            os.link(tmp, path)  # atomic, also on NFS: fails when a lock exists
        except FileExistsError:
            _replace_if_stale(path, tmp, has_locks)
    except BaseException:
        os.close(fd)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    lock = ResultsLock(path, fd, info)
    _held[str(path)] = lock
    atexit.register(lock.release)
    return lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    then = os.fstat(fd)
    return (then.st_dev, then.st_ino) == (now.st_dev, now.st_ino)


def _replace_if_stale(path: Path, tmp: Path, has_locks: bool | None) -> None:
    """Put our lock file in place of a stale one, or raise naming the live holder.

    Two workflows may find the same stale file: each opens it and takes its flock in turn. The
    one that gets it first puts its own file in place while it still holds the stale one's
    flock; the other gets that flock only after, finds the name now names another file, and
    judges that one (held: busy), so that only one of them ever takes the folder."""
    while True:
        try:
            old = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # released meanwhile
            try:
                os.link(tmp, path)
                return
            except FileExistsError:  # and taken again by a racer: judge its file
                continue
        try:
            free = _flock(old) if has_locks else None
            if free and not _same_file(old, path):  # replaced while we reached it: judge the new one
                continue
            holder = _read(path)
            stale = free if free is not None else _stale_without_locks(holder)
            if not stale:
                raise ResultsFolderBusy(busy_message(path, holder, checked=free is not None))
            os.replace(tmp, path)  # while the stale file's flock is ours: a racer judges our file next
            print(f"distlab: cleared a stale results lock ({holder_text(holder)}: that process is gone)",
                  file=sys.stderr)
            return
        finally:
            os.close(old)


def busy_message(path: Path, holder: dict, checked: bool) -> str:
    alive = ("it holds the lock now" if checked else
             "this file system has no working file locks, so whether it still runs is not known here")
    return (f"results folder {path.parent} is in use by another distlab workflow: {holder_text(holder)}; "
            f"{alive}. Two workflows on one results folder delete each other's outputs, so this one stops "
            f"before touching anything. Wait for it to finish, or give this run another results_dir. If that "
            f"process is gone for sure (a crashed host), delete {path} and start again.")


def is_read_only_call(argv: list[str]) -> bool:
    """True for a snakemake command line that runs no job (-n, --lint, --list-rules, ...).
    Decided by Snakemake's own argument parser, built only when a flag could say so (it
    costs ~0.5 s, too much for every no-op rerun)."""
    program = Path(argv[0]).name if argv else ""
    if program not in ("snakemake", "__main__.py") or not any(
            a in READ_ONLY_OPTIONS or (a[:1] == "-" and a[1:2] != "-" and set(a[1:]) & set("nlSD"))
            for a in argv[1:]):
        return False
    from snakemake.cli import get_argument_parser

    try:
        args = get_argument_parser().parse_args(argv[1:])
    except SystemExit:
        return False
    return any(getattr(args, dest, None) for dest in READ_ONLY_DESTS)


def hold_for_workflow(results_dir: str, workflow) -> ResultsLock | None:
    """The Snakefile's call: the main Snakemake process of a call that can run jobs takes the
    lock; job processes (cluster jobs, group jobs) and read-only calls do not."""
    if not workflow.is_main_process or is_read_only_call(sys.argv):
        return None
    return acquire(results_dir)
