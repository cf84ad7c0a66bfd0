"""Rules links and unequal: the opt-in targets' card pages (distlab/report/pages.py reads the
rule's declared inputs; distlab/report/cards/links.py, unequal.py build the cards)."""
from distlab.report.inputs import declared_inputs
from distlab.report.pages import links_page, unequal_page
from distlab.jobs.rule_log import logged

with logged(snakemake):
    out, declared = snakemake.output, declared_inputs(snakemake.input)
    if snakemake.rule == "links":
        links_page(list(snakemake.input.metrics), list(snakemake.input.collectives), out.html, out.readme, out.json,
                   declared)
    else:
        unequal_page(list(snakemake.input.metrics), out.html, out.readme, out.json, declared)
