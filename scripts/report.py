"""Rule report: the milestone report (HTML with embedded plots, and Markdown)."""
from distlab.report.build import build_report
from distlab.smk import logged

with logged(snakemake):
    build_report(list(snakemake.input.metrics), snakemake.output.html, snakemake.output.readme,
                 advice_paths=list(snakemake.input.advice))
