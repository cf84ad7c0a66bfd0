"""Whether this machine can make hosts joined by a capped link (network namespaces, a veth
pair, a tbf qdisc, a bridge: distlab.launchers.links makes them), and the tbf qdisc both use.

A bottom-layer module because the config check asks first: an experiment with a `link` is
refused, naming why, before any job starts (distlab.configuration.config_links.machine_refusal;
rules/common.smk for `snakemake two_hosts`). Imports nothing of distlab.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

# A token bucket of at least 64 KiB (one GSO packet) or 2 ms at the rate; packets wait up to
# 100 ms for tokens before tbf drops them (TCP then backs off, as on a real saturated link).
TBF_LATENCY = "100ms"


def burst_bytes(mbit: float) -> int:
    return max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))


def tbf_command(device: str, mbit: float) -> list[str]:
    return ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit:g}mbit",
            "burst", str(burst_bytes(mbit)), "latency", TBF_LATENCY]


@functools.lru_cache(maxsize=1)
def refusal() -> str | None:
    """Why capped links cannot be made on this machine, or None when they can. Tries the
    real thing once per process (a throwaway namespace with a veth pair and a tbf qdisc,
    gone when the probe exits: about 20 ms)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return ("making network namespaces, veth pairs and tc qdiscs needs root (CAP_SYS_ADMIN and "
                f"CAP_NET_ADMIN); this process runs as uid {os.geteuid()}")
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (iproute2 and util-linux)"
    probe = " && ".join([
        "ip link add probe0 type veth peer name probe1", "ip link set probe0 up", "ip link set probe1 up",
        " ".join(tbf_command("probe0", 100)), "ip link add probebr type bridge"])
    try:
        proc = subprocess.run(["unshare", "--net", "sh", "-c", probe], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not make a test namespace: {exc}"
    if proc.returncode:
        return f"a test namespace with a veth pair, a tbf qdisc and a bridge failed: {proc.stderr.strip()[:300]}"
    return None
