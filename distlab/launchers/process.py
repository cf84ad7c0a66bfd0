"""Starting a launcher process and waiting for it: the one place processes are handled."""
from __future__ import annotations

import subprocess
from pathlib import Path


def run_ranks(cmd: list[str], env: dict, log_path: str | None, timeout: float | None) -> None:
    """Run a launcher (torchrun, accelerate launch, a Ray driver) to completion; its output
    goes to log_path. A non-zero exit raises with the log's last lines."""
    log = open(log_path, "a") if log_path else None
    try:
        if log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
        proc = subprocess.run(cmd, env=env, stdout=log or None, stderr=subprocess.STDOUT if log else None,
                              timeout=timeout)
    finally:
        if log:
            log.close()
    if proc.returncode != 0:
        tail = ""
        if log_path:
            tail = "".join(Path(log_path).read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"training ranks exited with status {proc.returncode}; last log lines:\n{tail}")
