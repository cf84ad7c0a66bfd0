"""Unequal CPU devices: a rank's share of CPU time, enforced by the kernel (CFS bandwidth).

On CPU a "device" is a number of cores (`cpu_threads_per_rank`). A slower device is fewer
cores' worth of time: `rank_cpu_budget: [1.0, 0.5]` lets rank 1 run for at most half a core
(cgroup `cpu.cfs_quota_us` = 0.5 x `cpu.cfs_period_us` on cgroup v1, `cpu.max` on v2),
whatever else the machine does. This avoids the trap of unequal thread counts on a small
machine: three OpenMP threads on two cores spend their time in barriers waiting for a
descheduled peer (measured here: a 6 ms step took 200-400 ms).

Each rank makes its own group `<cpu cgroup>/distlab/<pid>` and moves itself into it once
its libraries are imported, and back out after its last step: the budget covers loading the
model, the `auto` probe and the steps (distlab.rank.worker); the kernel applies it to all threads.
A group whose processes are gone is
empty and is removed by `sweep()`, which the launcher runs after its ranks end and before
it starts new ones (a killed run's empty groups go then). Needs root and a writable cpu
cgroup controller: `refusal()` says why not, and the config check names it before any job
starts: that is why this module sits in the bottom layer (it imports nothing of distlab).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

# A 10 ms period (the kernel's default is 100 ms): a capped rank is throttled in slices shorter
# than a training step, so its steps are uniformly slower rather than some fast, some stalled.
PERIOD_US = 10_000
V1_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")


def controller() -> tuple[Path, int] | None:
    """(folder, cgroup version) of the cpu controller this machine mounts, if any."""
    for root in V1_ROOTS:
        if Path(root, "cpu.cfs_quota_us").exists():
            return Path(root), 1
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        controllers = Path(root, "cgroup.controllers")
        if controllers.is_file() and "cpu" in controllers.read_text().split():
            return Path(root), 2
    return None


@functools.lru_cache(maxsize=1)
def refusal() -> str | None:
    """Why rank CPU budgets cannot be enforced here, or None (tries a throwaway group)."""
    found = controller()
    if found is None:
        return "no cpu cgroup controller is mounted (cgroup v1 cpu or v2 with cpu enabled)"
    root, version = found
    probe = root / "distlab" / f"probe-{os.getpid()}"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        _write_quota(probe, version, 0.5)
    except OSError as exc:
        return f"cannot make a cpu cgroup under {root} ({exc.strerror}; needs root and a writable controller)"
    finally:
        if probe.is_dir():
            probe.rmdir()
    return None


def _write_quota(group: Path, version: int, cores: float) -> None:
    quota = int(cores * PERIOD_US)
    if version == 1:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")


def read_quota(group: Path, version: int) -> float:
    """Cores of CPU time the group may use, read back from the kernel's files."""
    if version == 1:
        return int((group / "cpu.cfs_quota_us").read_text()) / int((group / "cpu.cfs_period_us").read_text())
    quota, period = (group / "cpu.max").read_text().split()
    return int(quota) / int(period)


def enter(cores: float) -> dict:
    """Move this process into a group of its own capped at `cores`; returns what the kernel
    now enforces (read back), so a run records its devices, not its config."""
    found = controller()
    if found is None:
        raise RuntimeError(refusal() or "no cpu cgroup controller")
    root, version = found
    group = root / "distlab" / str(os.getpid())
    group.mkdir(parents=True, exist_ok=True)
    _write_quota(group, version, cores)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    member = any(line.rstrip().endswith(f"/distlab/{os.getpid()}") for line in open("/proc/self/cgroup"))
    return {"cgroup": str(group), "version": version, "cores": read_quota(group, version), "member": member,
            "how": "CFS bandwidth: cpu.cfs_quota_us / cpu.cfs_period_us (v1) or cpu.max (v2) of the rank's own group"}


def leave(record: dict) -> None:
    """Move this process back to the controller's root group (no limit): after its last step a
    rank's evaluation, save and export are not the device's training speed."""
    root = Path(record["cgroup"]).parent.parent
    (root / "cgroup.procs").write_text(str(os.getpid()))


def sweep() -> list[str]:
    """Remove distlab's empty groups (their ranks have ended); busy ones stay."""
    found = controller()
    removed = []
    if found is None or not (found[0] / "distlab").is_dir():
        return removed
    for group in (found[0] / "distlab").iterdir():
        if group.is_dir():
            try:
                group.rmdir()  # the kernel refuses while a process is inside
                removed.append(str(group))
            except OSError:
                continue
    return removed
