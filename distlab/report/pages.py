"""A page of its own for the opt-in targets (`snakemake links`, `unequal`, `two_hosts`): their
card, rendered like the milestone report (HTML with plots, and Markdown), with every run it
used in the table at the end. This module is their door: it reads the files the target's rule
declares and hands the cards (distlab/report/cards/links.py, unequal.py, two_hosts.py) what
they build from; a card opens no file."""
from __future__ import annotations

import json
import os
from dataclasses import replace

from distlab.report.cards import Card
from distlab.report.collect import load_checked_runs, read_json
from distlab.records.run_outputs import ResultsError
from distlab.report.render import render_html, render_markdown
from distlab.report.report_run import ReportRun


class PageLeavesOutItsRuns(ResultsError):
    """A page whose own runs (its rule's inputs) do not all read: it is not written."""


def checked_runs(metrics_paths, named_folder: bool = True, declared: frozenset[str] | None = None,
                 all_or_none: bool = True) -> list[dict]:
    """The runs that read and hold every figure they promise (collect.load_checked_runs), with
    only the `declared` files beside them read. Every run a page is given is one of its own
    stage, which its target has just trained: one that does not read stops the page, naming
    it (a page that says "0 runs" of a stage whose runs are all there would be a false page).
    all_or_none False: one left out is named on stderr (a card that fails its goal without it)."""
    import sys

    runs, rejected = load_checked_runs(list(metrics_paths), named_folder, declared)
    for item in rejected:
        print(f"WARNING: left out of the card: {item['reason']}", file=sys.stderr)
    if rejected and all_or_none:
        raise PageLeavesOutItsRuns(f"{len(rejected)} of the {len(rejected) + len(runs)} run(s) of this page do not "
                                   "read, so no page is written: " + "; ".join(item["reason"] for item in rejected))
    # Absolute folders: the card's evidence links are made relative to the page's own folder.
    return [replace(run, folder=os.path.abspath(run.folder)) for run in runs]


def write_page(card: Card, runs: list[ReportRun], html_path: str, md_path: str) -> None:
    rows = [{"machine": run.machine} for run in runs]  # the header's run count and machines
    out_dir = os.path.dirname(os.path.abspath(html_path))
    os.makedirs(out_dir, exist_ok=True)
    versions = "; ".join(sorted({f"torch {r.section('versions').get('torch')}, ray {r.section('versions').get('ray')}"
                                 for r in runs if r.section("versions")}))
    with open(html_path, "w") as fh:
        fh.write(render_html([card], rows, out_dir, versions, title=f"distlab: {card.title}"))
    with open(md_path, "w") as fh:
        fh.write(render_markdown([card], rows, out_dir, versions, title=f"distlab: {card.title}"))


def write_evidence(evidence: dict, html_path: str, json_path: str) -> None:
    """card.json: what the advisor cites from an opt-in card, with the page it came from."""
    evidence["card"] = os.path.abspath(html_path)
    with open(json_path, "w") as fh:
        json.dump(evidence, fh, indent=1)


def links_page(metrics_paths, collectives_paths, html_path: str, md_path: str, json_path: str,
               declared: frozenset[str] | None = None) -> None:
    """Rule links: the stage `links` runs and the collectives measured at each link cap."""
    from distlab.configuration.config_links import link_label
    from distlab.report.cards import links

    runs = checked_runs(metrics_paths, declared=declared)
    collectives = {}
    for path in collectives_paths:
        result = read_json(path, "link collectives", None)
        collectives[link_label(result["link"]["bandwidth_mbit"])] = result
    card, evidence = links.build(runs, collectives)
    write_page(card, runs, html_path, md_path)
    write_evidence(evidence, html_path, json_path)


def unequal_page(metrics_paths, html_path: str, md_path: str, json_path: str,
                 declared: frozenset[str] | None = None) -> None:
    """Rule unequal: uniform against sized batches on ranks of unequal speed."""
    from distlab.report.cards import unequal

    runs = checked_runs(metrics_paths, declared=declared)
    card, evidence = unequal.build(runs)
    write_page(card, runs, html_path, md_path)
    write_evidence(evidence, html_path, json_path)


def two_hosts_page(metrics_path: str, hosts_path: str, html_path: str, md_path: str,
                   declared: frozenset[str] | None = None) -> None:
    """Rule two_hosts: its one run (in results/<machine>/two-hosts/, not a folder named by its
    id) and the hosts record (which host ran which rank)."""
    from distlab.report.cards import two_hosts

    # Its card fails its goal, naming why, when the run left no readable metrics.
    runs = checked_runs([metrics_path], named_folder=False, declared=declared, all_or_none=False)
    record = read_json(hosts_path, "hosts record", None)
    write_page(two_hosts.build(runs[0] if runs else None, record), runs, html_path, md_path)
