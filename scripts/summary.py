"""Rule summary: one row per run across every machine folder (pandas). A run that cannot be
trusted (corrupt, another schema version, a promised figure missing) is left out and named
in summary-rejected.json and the log."""
import json
import sys

from distlab.report.held_out import eval_columns
from distlab.records.run_outputs import ResultsError
from distlab.report.collect import load_checked_runs
from distlab.report.summary_table import spreadsheet_safe, summary_frame
from distlab.report.inputs import declared_inputs
from distlab.jobs.rule_log import logged

with logged(snakemake):
    runs, rejected = load_checked_runs(list(snakemake.input.mine) + list(snakemake.input.shared),
                                       declared=declared_inputs(snakemake.input))  # it reads no other file
    # This workflow's own runs are all in it or the summary fails, naming them: one the
    # results schema refuses (a stage it does not know) must not vanish from an exit-0 report.
    own = {str(path) for path in snakemake.input.mine}
    own_left_out = [item["reason"] for item in rejected if item["path"] in own]
    if own_left_out:
        raise ResultsError(f"{len(own_left_out)} run(s) this workflow trained do not read, so no summary is "
                           "written: " + "; ".join(own_left_out))
    rejected = list(snakemake.params.ignored) + rejected
    for item in rejected:
        print(f"WARNING: left out of the summary: {item['reason']}", file=sys.stderr)
    with open(snakemake.output.rejected, "w") as fh:
        json.dump(rejected, fh, indent=1)
    frame = eval_columns(summary_frame(runs), runs)
    spreadsheet_safe(frame).to_csv(snakemake.output.csv, index=False)
    print(frame.to_string())
