"""Rule advise: recommend a strategy for this hardware and model, with memory estimates."""
import json

from distlab.tools.advisor import advise, render_markdown
from distlab.jobs.rule_log import logged

with logged(snakemake):
    with open(snakemake.input.model) as fh:
        model_config = json.load(fh)
    with open(snakemake.input.hardware) as fh:
        hardware = json.load(fh)
    config = {"advisor": dict(snakemake.params.advisor), "defaults": dict(snakemake.params.defaults)}
    collectives = None
    if snakemake.input.collectives:
        with open(snakemake.input.collectives[0]) as fh:
            collectives = json.load(fh)
    advice = advise(model_config, hardware, config, cpu_ranks=snakemake.params.cpu_ranks, collectives=collectives,
                    evidence=dict(snakemake.params.evidence))
    with open(snakemake.output.json, "w") as fh:
        json.dump(advice, fh, indent=1)
    text = render_markdown(advice)
    with open(snakemake.output.md, "w") as fh:
        fh.write(text)
    print(text)
