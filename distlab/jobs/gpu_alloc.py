"""GPU device ids for concurrent jobs on one machine.

Snakemake's `resources: gpu=N` only counts GPUs: two 2-GPU jobs on a 4-GPU box both start,
and without help both would use devices 0 and 1. Each job here takes an exclusive fcntl
lock on one file per device under <lock_dir>/<hostname>/ and hands the ranks exactly those
ids in CUDA_VISIBLE_DEVICES. The kernel drops a process's locks when it exits, however it
dies, so a killed job never leaves a device taken. The host name in the path keeps
machines that share a results folder (NFS under Slurm) from blocking each other.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time


class GpuAllocationError(RuntimeError):
    """Not enough devices exist, or none came free in time."""


LOCK_DIR_ENV = "DISTLAB_GPU_LOCK_DIR"


def lock_dir_for(results_dir: str | os.PathLike) -> str:
    """The one lock folder of every job that takes GPUs from a results folder (training,
    validation, the collectives benchmark): $DISTLAB_GPU_LOCK_DIR, else <results>/.gpu-locks."""
    return os.environ.get(LOCK_DIR_ENV) or os.path.join(os.path.abspath(results_dir), ".gpu-locks")


def visible_devices(count: int | None = None) -> list[str]:
    """The device ids this job may choose from: CUDA_VISIBLE_DEVICES when the parent set
    it (a Slurm allocation), else 0..count-1 (count detected through NVML when None)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        return [d.strip() for d in inherited.split(",") if d.strip()]
    if count is None:
        from distlab.configuration.hardware import gpu_count

        count = gpu_count()
    return [str(i) for i in range(count)]


def _try_lock(path: str):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
    return fd


@contextlib.contextmanager
def allocate(n: int, lock_dir: str, devices: list[str] | None = None, timeout: float = 3600.0,
             poll: float = 0.5):
    """Hold n free devices (exclusive locks) for the duration of the block; yields their ids.

    Either all n are taken or none: a job never sits on part of a set while waiting, so
    two jobs cannot deadlock each holding half of what the other needs.
    """
    devices = visible_devices() if devices is None else list(devices)
    if n > len(devices):
        raise GpuAllocationError(f"the job needs {n} GPU(s); this machine exposes {len(devices)} "
                                 f"({','.join(devices) or 'none'})")
    folder = os.path.join(lock_dir, socket.gethostname())
    os.makedirs(folder, exist_ok=True)
    deadline = time.monotonic() + timeout
    while True:
        held = {}
        for device in devices:
            fd = _try_lock(os.path.join(folder, f"gpu{device}.lock"))
            if fd is not None:
                held[device] = fd
                if len(held) == n:
                    break
        if len(held) == n:
            break
        for fd in held.values():
            os.close(fd)  # closing drops the lock
        if time.monotonic() > deadline:
            raise GpuAllocationError(f"no {n} free GPU(s) among {devices} within {timeout:.0f} s "
                                     f"(locks under {folder})")
        time.sleep(poll)
    try:
        yield list(held)
    finally:
        for fd in held.values():
            os.close(fd)
