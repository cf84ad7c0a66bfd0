"""Rule train: write this experiment's job file and start its ranks."""
import json
import os
from pathlib import Path

from distlab.jobs.launch import launch, rule_job
from distlab.records.run_outputs import one_line
from distlab.jobs.rule_log import logged

with logged(snakemake):
    run_dir = os.path.dirname(snakemake.output.metrics)
    job = rule_job(snakemake, run_dir)
    status = launch(job)
    print(f"experiment {job.spec.id}: {status}")
    if status == "oom":
        # Recorded as a result (the model did not fit), not a pipeline failure.
        import shutil

        folder = Path(snakemake.output.checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        for partial in folder.glob("*.tmp"):  # a save the out-of-memory exit cut short
            shutil.rmtree(partial, ignore_errors=True)
        Path(folder, "NO_CHECKPOINT").write_text("run ended out of memory; see metrics.json\n")

# One line on the terminal Snakemake runs in (everything else went to the job log above).
print(one_line(json.loads(Path(snakemake.output.metrics).read_text())), flush=True)
