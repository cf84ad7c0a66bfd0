"""The report's two renderings of its cards: self-contained HTML (plots embedded, readable on
a phone, printable) and Markdown, with evidence links relative to the report folder."""
from __future__ import annotations

import datetime
import html
import os

from distlab.report.cards import COMPARED, FAILED, NOT_RUN, PASSED, Card

BADGE = {PASSED: "#1a7f37", FAILED: "#cf222e", NOT_RUN: "#6e7781", COMPARED: "#9a6700"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:980px;margin:auto;padding:.75rem;
color:#1f2328;line-height:1.45}
p,li{overflow-wrap:anywhere}
.card{border:1px solid #d0d7de;border-radius:8px;padding:.8rem 1rem;margin:1rem 0;break-inside:avoid}
.badge{color:#fff;border-radius:4px;padding:0 .4rem;font-size:.85em;white-space:nowrap}
table{border-collapse:collapse;font-size:.8em;display:block;overflow-x:auto;max-width:100%}
td,th{border:1px solid #d0d7de;padding:.2rem .4rem;text-align:right;white-space:nowrap}
img{max-width:100%;height:auto}
.how{color:#57606a;font-size:.85em}
nav{display:flex;flex-wrap:wrap;gap:.2rem .8rem}
@media print{.card{page-break-inside:avoid} nav{display:none} a{color:inherit}}
"""


def _rel(path, out_dir):
    return os.path.relpath(path, out_dir)


def render_html(sections: list[Card], frame, out_dir: str, versions: str, title: str = "distlab milestone report") -> str:
    machines = ", ".join(sorted(set(frame["machine"]))) if len(frame) else "none"
    nav = " ".join(f"<a href='#s{c.number}'>{html.escape(c.title.split(' - ')[0])}</a>" for c in sections)
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'><link rel='icon' href='data:,'>",
             f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p class='how'>Built {datetime.datetime.now().isoformat(timespec='seconds')} from {len(frame)} run(s) "
             f"on machine(s): {html.escape(machines)}. Every figure is measured by the pipeline; each says how. "
             f"{html.escape(versions)}</p><nav>{nav}</nav>"]
    for card in sections:
        parts.append(f"<section class='card' id='s{card.number}'><h2>{html.escape(card.title)}</h2>")
        if card.goals:
            parts.append("<ul>")
            for goal in card.goals:
                links = " ".join(f"<a href='{html.escape(_rel(l, out_dir))}'>evidence</a>" for l in goal.links)
                parts.append(f"<li><span class='badge' style='background:{BADGE[goal.status]}'>{goal.status}</span> "
                             f"<b>{goal.kind}</b>: {html.escape(goal.text)}<br><span class='how'>"
                             f"{html.escape(goal.evidence)}</span> {links}</li>")
            parts.append("</ul>")
        parts += [f"<p>{html.escape(note)}</p>" for note in card.notes]
        for table in card.tables:
            parts.append(f"<h3>{html.escape(table.title)}</h3>{table.frame.to_html(index=False, border=0)}"
                         f"<p class='how'>{html.escape(table.how)}</p>")
        for fig in card.figures:
            parts.append(f"<h3>{html.escape(fig.title)}</h3><img alt='{html.escape(fig.title)}' "
                         f"src='data:image/png;base64,{fig.png_b64}'><p class='how'>{html.escape(fig.how)}</p>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _table_markdown(frame) -> str:
    try:
        return frame.to_markdown(index=False)
    except ImportError:  # tabulate missing: still readable
        return "```\n" + frame.to_string(index=False) + "\n```"


def render_markdown(sections: list[Card], frame, out_dir: str, versions: str,
                    title: str = "distlab milestone report") -> str:
    lines = [f"# {title}", "",
             f"{len(frame)} run(s); open index.html for the plots. Every figure is measured by the pipeline. "
             f"{versions}", ""]
    for card in sections:
        lines += [f"## {card.title}", ""]
        for goal in card.goals:
            links = " ".join(f"[evidence]({_rel(l, out_dir)})" for l in goal.links)
            lines.append(f"- **{goal.status}** ({goal.kind}) {goal.text}: {goal.evidence} {links}".rstrip())
        lines.append("")
        for note in card.notes:
            lines += [note, ""]
        for table in card.tables:
            lines += [f"### {table.title}", "", _table_markdown(table.frame), "", f"_{table.how}_", ""]
        for fig in card.figures:
            lines += [f"- Figure in index.html: {fig.title} ({fig.how})", ""]
    return "\n".join(lines)
