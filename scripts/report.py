"""Rule report: the milestone report (HTML with embedded plots, and Markdown), from the runs
the summary accepted (distlab.report.collect.load_checked_runs names the others)."""
import sys

from distlab.report.build import build_report
from distlab.report.collect import load_checked_runs
from distlab.rule_log import logged

with logged(snakemake):
    runs, rejected = load_checked_runs(list(snakemake.input.metrics))
    left_out = build_report([run["_path"] for run in runs], snakemake.output.html, snakemake.output.readme,
                            advice_paths=list(snakemake.input.advice),
                            left_out=list(snakemake.params.ignored) + rejected)
    for item in left_out:
        print(f"WARNING: left out of the report: {item['reason']}", file=sys.stderr)
