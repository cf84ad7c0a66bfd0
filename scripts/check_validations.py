"""Rule check_validations: fail the workflow when any checkpoint validation failed (after
the report, which shows why, was built)."""
import json
import sys

from distlab.rule_log import logged

with logged(snakemake):
    failed = []
    for path in snakemake.input.validations:
        result = json.load(open(path))
        if result.get("status") != "passed":
            failed.append(f"{path}: {result.get('status')} ({result.get('reason', 'no reason recorded')})")
    if failed:
        print("checkpoint validation failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        sys.exit(1)
    with open(snakemake.output[0], "w") as fh:
        fh.write(f"{len(snakemake.input.validations)} checkpoint validation(s) passed\n")
