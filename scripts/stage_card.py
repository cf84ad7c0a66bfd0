"""Rules links and unequal: the opt-in targets' card pages (distlab/report/cards/links.py, unequal.py)."""
from distlab.rule_log import logged

with logged(snakemake):
    out = snakemake.output
    if snakemake.rule == "links":
        from distlab.report.cards.links import write_card

        write_card(list(snakemake.input.metrics), list(snakemake.input.collectives), out.html, out.readme, out.json)
    else:
        from distlab.report.cards.unequal import write_card

        write_card(list(snakemake.input.metrics), out.html, out.readme, out.json)
