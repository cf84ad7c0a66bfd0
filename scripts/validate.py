"""Rule validate_checkpoint: validate one experiment's checkpoints into validation.json."""
import os

from distlab.jobs.rule_log import logged
from distlab.jobs.validate import validate_run

with logged(snakemake):
    os.makedirs(snakemake.output.work, exist_ok=True)  # a declared output, also when no launch ran
    # The ranks inherit this script's stdout/stderr, which logged() sends to the rule's log.
    result = validate_run(os.path.dirname(snakemake.input.metrics), snakemake.params.model_source,
                          snakemake.input.data, snakemake.output[0])
    print(f"experiment {result['experiment']}: checkpoint validation {result['status']}")
