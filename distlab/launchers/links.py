"""Hosts joined by a link you can set: network namespaces, veth pairs, a bridge and `tc`.

`LinkedHosts(n, bandwidth_mbit)` makes n "hosts" on one machine, each its own network
namespace holding only `lo` and one interface `eth0` (address 10.77.0.<i+1>/24), all plugged
into one bridge that lives in a further namespace (the "switch"). With a bandwidth, every
host's eth0 (its upload) and the switch's port towards it (its download) are capped by a
`tbf` token bucket: each host has a NIC of that speed, as machines on one switch do.

What is sent, and where: nothing leaves the namespaces a run made. No interface is ever
created in the machine's own namespace (each veth is created straight into its two
namespaces), no route leads out, and a process started inside a host namespace (`inside()`)
can reach only the other hosts of the same run. Listening on any address there (torchrun's
store, gloo, Ray) therefore reaches those hosts and nothing else.

Lifetime: the namespaces are anonymous (no /var/run/netns entry) and each is held by a
"holder" process that sleeps in it. A network namespace dies with the last process in it,
and its veth ends and bridge die with it, so:
- the job ends: `close()` kills every process in the run's namespaces, then the holders;
- the job is killed (SIGKILL, no cleanup code runs): the holders asked the kernel to die
  with their parent (PR_SET_PDEATHSIG), the ranks die with theirs, and the namespaces go;
- anything that still survived (a Ray daemon that ignores its parent): every process a run
  starts inside its namespaces carries LINK_ENV = its owner's pid and start time in its
  environment (inherited by all its descendants), and `sweep_leftovers()` (run before each
  new link) kills every tagged process whose owner is gone; their namespaces go with them.

Root is needed (CAP_NET_ADMIN for veth/tc, CAP_SYS_ADMIN to make a namespace):
`refusal()` (distlab.configuration.netns: the config check asks it) says why links cannot be
made here before any job starts. `netem` (delay) and `fq_codel` are not available on every kernel; `tbf` is.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from distlab.configuration.netns import TBF_LATENCY, burst_bytes, refusal, tbf_command

SUBNET = "10.77.0"
INTERFACE = "eth0"
MARKER = "distlab-link"
# Set in every process a run starts inside its namespaces: "<owner pid>@<owner start time>".
LINK_ENV = "DISTLAB_LINK_OWNER"
# The holder: prints one line once it runs inside its new namespace, then sleeps.
HOLDER = "import signal, sys; print('ready', flush=True); signal.pause()"


def address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"


def _owner_tag(pid: int) -> str:
    import psutil

    return f"{pid}@{psutil.Process(pid).create_time():.2f}"


def _owner_alive(tag: str) -> bool:
    import psutil

    pid, _, started = tag.partition("@")
    try:
        return f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except (psutil.NoSuchProcess, ValueError):
        return False


def netns_id(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def processes_in(namespace: str) -> list[int]:
    """Pids of every process whose network namespace is `namespace` (a net:[inode] link)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and netns_id(entry.name) == namespace:
            found.append(int(entry.name))
    return found


def kill_namespace(namespace: str, grace: float = 0.0) -> list[int]:
    """SIGKILL every process in a namespace (optionally SIGTERM first, for `grace` seconds);
    the namespace then goes with the last of them."""
    victims = processes_in(namespace)
    if grace and victims:
        for pid in victims:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while processes_in(namespace) and time.monotonic() < deadline:
            time.sleep(0.1)
    for _ in range(50):  # a dying process may have forked once more
        left = processes_in(namespace)
        if not left:
            break
        for pid in left:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.05)
    return victims


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tagged_processes() -> list[tuple[int, str]]:
    """(pid, owner tag) of every process of any run's namespaces: the holders and whatever
    was started inside (inside() sets LINK_ENV, which every descendant inherits)."""
    found = []
    needle = f"{LINK_ENV}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(needle):
                found.append((int(entry.name), item[len(needle):].decode()))
                break
    return found


def sweep_leftovers() -> list[int]:
    """Kill what is left of runs whose owner process is gone (killed before its cleanup): every
    tagged process, so that their namespaces go too. Returns the pids killed."""
    dead = [pid for pid, owner in tagged_processes() if not _owner_alive(owner)]
    for pid in dead:
        _signal(pid, signal.SIGKILL)
    return dead


def interface_counters(interface: str = INTERFACE) -> dict | None:
    """This process's namespace's byte counters of `interface` (None where it has none: a
    rank not on a link). A rank reads them around its steps: the traffic of training alone."""
    for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
        name, values = line.split(":", 1)
        if name.strip() == interface:
            v = [int(x) for x in values.split()]
            return {"rx_bytes": v[0], "tx_bytes": v[8]}
    return None


class LinkedHosts:
    """n hosts on one switch, each link capped at bandwidth_mbit (None: uncapped veth).
    A context manager: the namespaces exist inside the `with` block only."""

    def __init__(self, n_hosts: int, bandwidth_mbit: float | None = None):
        if n_hosts < 1 or n_hosts > 250:
            raise ValueError(f"1-250 hosts on one link, not {n_hosts}")
        self.n_hosts, self.bandwidth_mbit = n_hosts, bandwidth_mbit
        self.holders: dict[str, subprocess.Popen] = {}
        self.tag = _owner_tag(os.getpid())
        self.namespaces: dict[str, str] = {}

    # -- making --------------------------------------------------------------------------
    def __enter__(self) -> "LinkedHosts":
        reason = refusal()
        if reason:
            raise RuntimeError(f"cannot make linked hosts here: {reason}")
        sweep_leftovers()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hold(self, role: str) -> None:
        from distlab.launchers.process import die_with_parent

        owner = os.getpid()
        proc = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-c", HOLDER, f"{MARKER}:{role}"],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                env={**os.environ, LINK_ENV: self.tag},
                                preexec_fn=lambda: die_with_parent(owner), start_new_session=True)
        self.holders[role] = proc
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the namespace holder for {role} did not start (exit {proc.poll()})")
        namespace = netns_id(proc.pid)
        if namespace is None or namespace == netns_id(os.getpid()):
            # Never: close() kills every process in a run's namespaces.
            raise RuntimeError(f"the holder for {role} is not in a namespace of its own ({namespace})")
        self.namespaces[role] = namespace

    def _run_in(self, role: str, lines: list[str]) -> None:
        """`ip -batch` lines inside one namespace (tc lines start with 'tc ')."""
        for line in lines:
            tool, *args = line.split()
            cmd = ["nsenter", f"--net=/proc/{self.holders[role].pid}/ns/net", "--", tool, *args]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def _make(self) -> None:
        self._hold("switch")
        self._run_in("switch", ["ip link add br0 type bridge", "ip link set br0 up"])
        switch = self.holders["switch"].pid
        for i in range(self.n_hosts):
            role = self.role(i)
            self._hold(role)
            port = f"port{i}"
            # Both ends are created in their own namespaces: none ever exists in the machine's.
            subprocess.run(["ip", "link", "add", INTERFACE, "netns", str(self.holders[role].pid), "type", "veth",
                            "peer", "name", port, "netns", str(switch)], check=True, capture_output=True)
            host = [f"ip addr add {address(i)}/24 dev {INTERFACE}", f"ip link set {INTERFACE} up",
                    "ip link set lo up"]
            ports = [f"ip link set {port} master br0", f"ip link set {port} up"]
            if self.bandwidth_mbit:
                host.append(" ".join(tbf_command(INTERFACE, self.bandwidth_mbit)))
                ports.append(" ".join(tbf_command(port, self.bandwidth_mbit)))
            self._run_in(role, host)
            self._run_in("switch", ports)

    # -- using ---------------------------------------------------------------------------
    @staticmethod
    def role(index: int) -> str:
        return f"host{index}"

    def address(self, index: int) -> str:
        return address(index)

    def inside(self, index: int, command: list[str]) -> list[str]:
        """`command` run inside host `index`'s namespace, tagged with this run's owner (LINK_ENV).
        Never offered the run's warm-start server: a copy it forked would run in the server's
        namespace, not the host's (distlab.launchers.warm_start)."""
        from distlab.launchers.warm_start import SOCKET_ENV

        return ["nsenter", f"--net=/proc/{self.holders[self.role(index)].pid}/ns/net", "--",
                "env", "-u", SOCKET_ENV, f"{LINK_ENV}={self.tag}", *command]

    def counters(self) -> list[dict]:
        """Bytes and packets each host's eth0 sent and received so far (the kernel's counters)."""
        out = []
        for i in range(self.n_hosts):
            pid = self.holders[self.role(i)].pid
            for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
                name, values = line.split(":", 1)
                if name.strip() == INTERFACE:
                    v = [int(x) for x in values.split()]
                    out.append({"host": i, "address": address(i), "rx_bytes": v[0], "rx_packets": v[1],
                                "tx_bytes": v[8], "tx_packets": v[9], "tx_dropped": v[11]})
        return out

    def qdiscs(self) -> list[str]:
        """`tc qdisc show` of each host's eth0, as the kernel reports it."""
        out = []
        for i in range(self.n_hosts):
            cmd = self.inside(i, ["tc", "qdisc", "show", "dev", INTERFACE])
            out.append(subprocess.run(cmd, capture_output=True, text=True).stdout.strip())
        return out

    def interfaces(self, index: int) -> list[str]:
        """Interface names in a host's namespace (only lo and eth0)."""
        pid = self.holders[self.role(index)].pid
        return sorted(line.split(":", 1)[0].strip()
                      for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:])

    def describe(self) -> dict:
        return {"hosts": self.n_hosts, "bandwidth_mbit": self.bandwidth_mbit,
                "addresses": [address(i) for i in range(self.n_hosts)], "interface": INTERFACE,
                "qdisc": self.qdiscs(),
                "how": ("one network namespace per host, veth pairs to a bridge in a further namespace; "
                        + (f"tc tbf at {self.bandwidth_mbit:g} Mbit/s on each host's eth0 (upload) and on the "
                           f"bridge port towards it (download), burst {burst_bytes(self.bandwidth_mbit)} B, "
                           f"latency {TBF_LATENCY}" if self.bandwidth_mbit else "no qdisc: uncapped veth"))}

    # -- removing ------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process in the run's namespaces, then their holders: the namespaces,
        veths and bridge go with them."""
        for role, namespace in self.namespaces.items():
            if namespace:
                kill_namespace(namespace)
        for proc in self.holders.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
        self.holders.clear()
        self.namespaces.clear()
