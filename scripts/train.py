"""Rule train: write this experiment's job file and start its ranks."""
import json
import os
from pathlib import Path

from distlab.launch import launch
from distlab.run_outputs import one_line
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
        # Trackers' store beside the machine's runs (absolute, as above): results/<machine>/tracking.
        "tracking_dir": os.path.abspath(os.path.join(os.path.dirname(run_dir), "tracking")),
    }
    status = launch(job)
    print(f"experiment {job['spec']['id']}: {status}")
    if status == "oom":
        # Recorded as a result (the model did not fit), not a pipeline failure.
        Path(snakemake.output.checkpoint).mkdir(parents=True, exist_ok=True)
        Path(snakemake.output.checkpoint, "NO_CHECKPOINT").write_text("run ended out of memory; see metrics.json\n")

# One line on the terminal Snakemake runs in (everything else went to the job log above).
print(one_line(json.loads(Path(snakemake.output.metrics).read_text())), flush=True)
