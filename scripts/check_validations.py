"""Rule check_validations: fail the workflow when any checkpoint validation failed (after
the report, which shows why, was built)."""
import json
import sys

from distlab.jobs.rule_log import logged

with logged(snakemake):
    failed, skipped = [], []
    for path in snakemake.input.validations:
        result = json.load(open(path))
        if result.get("status") == "nothing to validate" and "'oom'" in result.get("reason", ""):
            # The run ended out of memory (a result the report shows) and saved no checkpoint.
            skipped.append(f"{path}: {result['reason']}")
        elif result.get("status") != "passed":
            failed.append(f"{path}: {result.get('status')} ({result.get('reason', 'no reason recorded')})")
    if failed:
        print("checkpoint validation failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        sys.exit(1)
    with open(snakemake.output[0], "w") as fh:
        fh.write(f"{len(snakemake.input.validations) - len(skipped)} checkpoint validation(s) passed\n"
                 + "".join(f"skipped, nothing saved: {line}\n" for line in skipped))
