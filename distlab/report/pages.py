"""A page of its own for the opt-in targets (`snakemake links`, `unequal`, `two_hosts`): their
card, rendered like the milestone report (HTML with plots, and Markdown), with every run it
used in the table at the end."""
from __future__ import annotations

import os

from distlab.report.cards import Card
from distlab.report.collect import load_checked_runs, summary_frame
from distlab.report.render import render_html, render_markdown


def checked_runs(metrics_paths, named_folder: bool = True) -> list[dict]:
    """The runs that read and hold every figure they promise (collect.load_checked_runs); a
    rejected one is named on stderr, never half-read."""
    import sys

    runs, rejected = load_checked_runs(list(metrics_paths), named_folder)
    for item in rejected:
        print(f"WARNING: left out of the card: {item['reason']}", file=sys.stderr)
    for run in runs:
        run["_dir"] = os.path.abspath(run["_dir"])
    return runs


def write_page(card: Card, runs: list[dict], html_path: str, md_path: str) -> None:
    frame = summary_frame(runs)
    out_dir = os.path.dirname(os.path.abspath(html_path))
    os.makedirs(out_dir, exist_ok=True)
    versions = "; ".join(sorted({f"torch {r['versions'].get('torch')}, ray {r['versions'].get('ray')}"
                                 for r in runs if r.get("versions")}))
    with open(html_path, "w") as fh:
        fh.write(render_html([card], frame, out_dir, versions, title=f"distlab: {card.title}"))
    with open(md_path, "w") as fh:
        fh.write(render_markdown([card], frame, out_dir, versions, title=f"distlab: {card.title}"))
