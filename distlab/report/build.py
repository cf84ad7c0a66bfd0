"""The milestone report: one card per roadmap stage, as self-contained HTML and Markdown."""
from __future__ import annotations

import datetime
import html
import os

from distlab.report.cards import FAILED, NOT_RUN, PASSED, all_cards
from distlab.report.collect import load_runs, summary_frame

BADGE = {PASSED: "#1a7f37", FAILED: "#cf222e", NOT_RUN: "#6e7781"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:980px;margin:auto;padding:1rem;
color:#1f2328;line-height:1.45}
.card{border:1px solid #d0d7de;border-radius:8px;padding:1rem;margin:1rem 0;break-inside:avoid}
.badge{color:#fff;border-radius:4px;padding:0 .4rem;font-size:.85em;white-space:nowrap}
table{border-collapse:collapse;font-size:.85em;display:block;overflow-x:auto}
td,th{border:1px solid #d0d7de;padding:.2rem .4rem;text-align:right}
img{max-width:100%;height:auto}
.how{color:#57606a;font-size:.85em}
@media print{.card{page-break-inside:avoid}}
"""


def _rel(path, out_dir):
    return os.path.relpath(path, out_dir)


def render_html(cards, frame, out_dir) -> str:
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             f"<title>distlab milestone report</title><style>{CSS}</style></head><body>",
             "<h1>distlab milestone report</h1>",
             f"<p class='how'>Built {datetime.datetime.now().isoformat(timespec='seconds')} from "
             f"{len(frame)} run(s) on machine(s): "
             f"{html.escape(', '.join(sorted(set(frame['machine']))) if len(frame) else 'none')}. "
             "Every figure is measured by the pipeline; each says how.</p>"]
    for card in cards:
        parts.append(f"<section class='card'><h2>{html.escape(card.title)}</h2><ul>")
        for goal in card.goals:
            links = " ".join(f"<a href='{html.escape(_rel(l, out_dir))}'>evidence</a>" for l in goal.links)
            parts.append(f"<li><span class='badge' style='background:{BADGE[goal.status]}'>{goal.status}</span> "
                         f"<b>{goal.kind}</b>: {html.escape(goal.text)}<br><span class='how'>"
                         f"{html.escape(goal.evidence)}</span> {links}</li>")
        parts.append("</ul>")
        for note in card.notes:
            parts.append(f"<p>{html.escape(note)}</p>")
        for table in card.tables:
            parts.append(f"<h3>{html.escape(table.title)}</h3>{table.frame.to_html(index=False, border=0)}"
                         f"<p class='how'>{html.escape(table.how)}</p>")
        for fig in card.figures:
            parts.append(f"<h3>{html.escape(fig.title)}</h3><img alt='{html.escape(fig.title)}' "
                         f"src='data:image/png;base64,{fig.png_b64}'><p class='how'>{html.escape(fig.how)}</p>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_markdown(cards, frame, out_dir) -> str:
    lines = ["# distlab milestone report", "",
             f"{len(frame)} run(s); open index.html for the plots. Every figure is measured by the pipeline.", ""]
    for card in cards:
        lines += [f"## {card.title}", ""]
        for goal in card.goals:
            links = " ".join(f"[evidence]({_rel(l, out_dir)})" for l in goal.links)
            lines.append(f"- **{goal.status}** ({goal.kind}) {goal.text}: {goal.evidence} {links}".rstrip())
        lines.append("")
        for note in card.notes:
            lines += [note, ""]
        for table in card.tables:
            lines += [f"### {table.title}", "", table.frame.to_markdown(index=False) if _has_tabulate()
                      else "```\n" + table.frame.to_string(index=False) + "\n```", "", f"_{table.how}_", ""]
    return "\n".join(lines)


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
        return True
    except ImportError:
        return False


def build_report(metrics_paths, html_path, md_path) -> None:
    runs = load_runs(metrics_paths)
    frame = summary_frame(runs)
    for run in runs:
        run["_dir"] = os.path.abspath(run["_dir"])
    cards = all_cards(runs)
    out_dir = os.path.dirname(os.path.abspath(html_path))
    os.makedirs(out_dir, exist_ok=True)
    with open(html_path, "w") as fh:
        fh.write(render_html(cards, frame, out_dir))
    with open(md_path, "w") as fh:
        fh.write(render_markdown(cards, frame, out_dir))
