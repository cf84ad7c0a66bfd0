"""Single-node launches that listen on loopback only: `python -m distlab.launchers.loopback
<module> <args>` runs torch's elastic agent (`torch.distributed.run`, or `accelerate.commands.launch`,
which calls it in-process) with its rendezvous store on a socket bound to 127.0.0.1.

Why: torch 2.13's TCPStore server binds every interface whatever host it is given
(`--rdzv-endpoint localhost:0` showed `*:<port>` in `ss -ltnp`), and the c10d dynamic
rendezvous keeps its state in that store as a pickle it loads again every few seconds: any
machine on the same network could reach it during a run. A single-node launch needs neither.
Here torch's static rendezvous (no pickled state; ranks are clients of the agent's store,
TORCHELASTIC_USE_AGENT_STORE) creates its store on a socket distlab bound to 127.0.0.1 and
hands it over with TCPStore's `master_listen_fd`. Port 0 is bound as 0: the OS picks a free
port at bind time, so concurrent jobs never share one (the property `localhost:0` had), and
the agent passes the real port to its ranks. The ranks' own gloo/NCCL sockets follow
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, set to the loopback interface (environment()).
"""
from __future__ import annotations

import runpy
import socket
import sys

LOOPBACK = "127.0.0.1"


def loopback_interface() -> str:
    """The interface that holds 127.0.0.1 (lo on Linux, lo0 on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def environment() -> dict:
    """What every rank of a single-node launch needs to keep its sockets on loopback."""
    interface = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def launcher_args() -> list[str]:
    """torchrun's rendezvous options for a single-node launch served by this module."""
    return ["--rdzv-backend=static", f"--master-addr={LOOPBACK}", "--master-port=0"]


def install() -> None:
    """Make torch's static rendezvous handler bind its store to loopback (rank 0's agent)."""
    from datetime import timedelta  # noqa: F401  (TCPStore's timeout type, kept by the parent class)

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    class LoopbackStaticRendezvous(static_tcp_rendezvous.StaticTCPRendezvous):
        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                if self.master_addr not in (LOOPBACK, "localhost"):
                    raise ValueError(f"distlab's single-node launch rendezvous on {LOOPBACK}, not {self.master_addr}")
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind((LOOPBACK, self.master_port))
                listener.listen(1024)
                self.master_addr, self.master_port = LOOPBACK, listener.getsockname()[1]
                # detach(): the store owns the listening socket for the rest of the launch.
                self._store = TCPStore(LOOPBACK, self.master_port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=listener.detach())
            return super().next_rendezvous()  # its bootstrap info carries the real port to the ranks

    create = static_tcp_rendezvous.create_rdzv_handler

    def create_loopback_handler(params):
        handler = create(params)
        handler.__class__ = LoopbackStaticRendezvous
        return handler

    static_tcp_rendezvous.create_rdzv_handler = create_loopback_handler


def main() -> None:
    module = sys.argv[1]
    sys.argv = [module] + sys.argv[2:]
    install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    from distlab.launchers.process import exit_without_teardown

    exit_without_teardown()  # the agent's ranks are done and reaped: skip the interpreter's teardown


if __name__ == "__main__":
    main()
