"""A warm-start server for a test module's launches (a run's is started by the Snakefile), and
what the tests read of it. Imported by the modules that use it: `from warm_fixtures import server`."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distlab.launchers import warm_start
from distlab.launchers.environment import warm_start_environment


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The socket of a server started under this process's environment, as the run's would be."""
    log = tmp_path_factory.mktemp("warm") / "warm-start.log"
    path = warm_start.start_server(warm_start_environment(), str(log))
    deadline = time.monotonic() + 120
    while "imported" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "imported" in log.read_text(), log.read_text()
    yield path
    warm_start.stop_server(path)
    assert not Path(path).parent.exists()


def server_pid(path: str) -> int:
    return int((Path(path).parent / warm_start.SERVER_RECORD).read_text().split()[0])


def server_log(path: str) -> str:
    """The server's log (its stdout)."""
    return Path(os.readlink(f"/proc/{server_pid(path)}/fd/1")).read_text()


def copies_of(path: str) -> list[int]:
    """The pids of the server's running copies (their records)."""
    return [int(name) for name in os.listdir(Path(path).parent / "copies")]
