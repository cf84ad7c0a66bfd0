"""Rule report: the milestone report (HTML with embedded plots, and Markdown), from the runs
the summary accepted (distlab.report.collect.load_checked_runs names the others), reading no
file the rule does not declare."""
import sys

from distlab.report.build import report_rule
from distlab.report.inputs import declared_inputs
from distlab.jobs.rule_log import logged

with logged(snakemake):
    left_out = report_rule(snakemake.input.metrics, snakemake.input.summary, snakemake.input.advice,
                           declared_inputs(snakemake.input), snakemake.output.html, snakemake.output.readme,
                           ignored=list(snakemake.params.ignored))
    for item in left_out:
        print(f"WARNING: left out of the report: {item['reason']}", file=sys.stderr)
