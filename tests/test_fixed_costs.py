"""Per-process fixed costs (benchmarks/harness_overhead.py): a rank imports only what it uses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a rank does: the model's code, then DeepSpeed.
A_RANKS_IMPORTS = """
import json, sys
from distlab.runtime.tracking import hide_mlflow
hidden = hide_mlflow(uses_it=False)
from distlab.runtime.model import import_model_code
import_model_code(sys.argv[1], lora=False)
facts = {"mlflow_hidden": hidden}
import deepspeed
from deepspeed.autotuning import autotuner
facts.update(mlflow_imported=sys.modules.get("mlflow") is not None, deepspeed_has_mlflow=autotuner.has_mlflow)
try:
    import mlflow  # noqa: F401
except ImportError as exc:
    facts["asking_for_mlflow"] = str(exc)
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def rank_imports(tmp_path_factory):
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # all AutoConfig reads
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", A_RANKS_IMPORTS, str(model)], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_deepspeed_process_that_writes_nothing_to_mlflow_never_imports_it(rank_imports):
    # DeepSpeed's autotuner does `try: import mlflow` at import time (~0.55-1.2 s of CPU here);
    # the worker hides MLflow on every rank but a tracking rank 0, validation ranks always.
    assert rank_imports["mlflow_hidden"] and not rank_imports["mlflow_imported"]
    assert rank_imports["deepspeed_has_mlflow"] is False  # DeepSpeed went on without it
    assert "mlflow" in rank_imports["asking_for_mlflow"]  # anyone else asking is told plainly
    from distlab.runtime.tracking import hide_mlflow

    assert not hide_mlflow(uses_it=True)  # the tracking rank 0 keeps it (nothing hidden here)

