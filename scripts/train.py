"""Rule train: write this experiment's job file and start its ranks."""
import os
from pathlib import Path

from distlab.launch import launch
from distlab.rule_log import logged

with logged(snakemake):
    run_dir = os.path.dirname(snakemake.output.metrics)
    job = {
        "spec": dict(snakemake.params.spec),
        "run_dir": run_dir,
        "data_dir": snakemake.input.data,
        "model_source": snakemake.params.model_source,
        "hardware_json": snakemake.input.hardware,
        "env_allowlist": list(snakemake.params.env_allowlist),
        "checkpoint_dir": snakemake.output.checkpoint,
        # The base model's eval loss, set beside the run's (absolute: Ray workers run elsewhere).
        "base_eval_json": os.path.abspath(snakemake.input.base_eval),
    }
    status = launch(job)
    print(f"experiment {job['spec']['id']}: {status}")
    if status == "oom":
        # Recorded as a result (the model did not fit), not a pipeline failure.
        import shutil

        folder = Path(snakemake.output.checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        for partial in folder.glob("*.tmp"):  # a save the out-of-memory exit cut short
            shutil.rmtree(partial, ignore_errors=True)
        Path(folder, "NO_CHECKPOINT").write_text("run ended out of memory; see metrics.json\n")
