"""Per-process fixed costs (benchmarks/harness_overhead.py): a rank imports only what it uses."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED_THEN_MLFLOW = """
import sys
from distlab.tracking import hide_mlflow
hidden = hide_mlflow(uses_it=sys.argv[1] == "tracks")
import deepspeed
from deepspeed.autotuning import autotuner
print(hidden, sys.modules.get("mlflow") is not None, autotuner.has_mlflow)
if hidden:  # whoever asks for MLflow in such a process is told plainly that it is not there
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        print("refused:", exc)
"""


def imports_after_deepspeed(role: str) -> list[str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", DEEPSPEED_THEN_MLFLOW, role], env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().splitlines()


def test_a_deepspeed_process_that_writes_nothing_to_mlflow_never_imports_it():
    # DeepSpeed's autotuner does `try: import mlflow` at import time (~0.55-1.2 s of CPU here);
    # the worker hides MLflow on every rank but a tracking rank 0, validation ranks always.
    first, refused = imports_after_deepspeed("silent")
    assert first == "True False False"  # hidden, not imported, DeepSpeed went on without it
    assert refused.startswith("refused:") and "mlflow" in refused
    from distlab.tracking import hide_mlflow

    assert not hide_mlflow(uses_it=True)  # the tracking rank 0 keeps it (nothing hidden here)

