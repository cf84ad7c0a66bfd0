"""The report's two renderings of its cards: self-contained HTML (plots embedded, readable on
a phone, printable) and Markdown, with evidence links relative to the report folder."""
from __future__ import annotations

import datetime
import html
import os
import re
from urllib.parse import quote

from distlab.report.cards import COMPARED, DOUBTFUL, FAILED, NOT_RUN, PASSED, Card

BADGE = {PASSED: "#1a7f37", FAILED: "#cf222e", NOT_RUN: "#6e7781", COMPARED: "#9a6700", DOUBTFUL: "#bc4c00"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1400px;margin:auto;padding:.75rem;
color:#1f2328;line-height:1.45}
p,li,summary{overflow-wrap:anywhere}
.card{border:1px solid #d0d7de;border-radius:8px;padding:.8rem 1rem;margin:1rem 0;break-inside:avoid;min-width:0}
.headline{border-width:2px;border-color:#0969da}
.badge{color:#fff;border-radius:4px;padding:0 .4rem;font-size:.85em;white-space:nowrap}
.frame{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.8em}
td,th{border:1px solid #d0d7de;padding:.2rem .4rem;text-align:right;white-space:nowrap}
td:first-child,th:first-child{position:sticky;left:0;background:#f6f8fa;text-align:left}
img{max-width:100%;height:auto}
.how{color:#57606a;font-size:.85em}
details.how summary{cursor:pointer}
nav{display:flex;flex-wrap:wrap;gap:.2rem .8rem}
@media print{.card{page-break-inside:avoid} nav{display:none} a{color:inherit} details{display:block}}
"""
# Text longer than this is folded under its first sentence: formula explanations, long notes.
FOLD_CHARS = 280


def _rel(path, out_dir):
    return os.path.relpath(path, out_dir)


def key_columns_first(frame):
    """A machine column that holds one machine says nothing per row: it goes last, so the column
    that names the row (run, experiment, strategy) is the one kept in view."""
    columns = list(frame.columns)
    if len(columns) > 1 and columns[0] == "machine" and frame["machine"].nunique() <= 1:
        return frame[columns[1:] + columns[:1]]
    return frame


def first_sentence(text: str) -> str:
    head = text.split(". ", 1)[0]
    return head if len(head) < FOLD_CHARS else head[:FOLD_CHARS].rsplit(" ", 1)[0] + " ..."


def folded(text: str, tag: str = "p", css: str = "") -> str:
    """A paragraph, or one folded under its first sentence (<details>) when it is long."""
    klass = f" class='{css}'" if css else ""
    if len(text) <= FOLD_CHARS:
        return f"<{tag}{klass}>{html.escape(text)}</{tag}>"
    return (f"<details{klass}><summary>{html.escape(first_sentence(text))}</summary>"
            f"<p>{html.escape(text)}</p></details>")


def render_html(sections: list[Card], summary: list[dict], out_dir: str, versions: str,
                title: str = "distlab milestone report") -> str:
    """summary: one row per run with its machine (summary.csv's rows), for the header."""
    machines = ", ".join(sorted({row["machine"] for row in summary})) if summary else "none"
    nav = " ".join(f"<a href='#s{c.number}'>{html.escape(c.title.split(' - ')[0])}</a>" for c in sections)
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'><link rel='icon' href='data:,'>",
             f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p class='how'>Built {datetime.datetime.now().isoformat(timespec='seconds')} from {len(summary)} run(s) "
             f"on machine(s): {html.escape(machines)}. Every figure is measured by the pipeline; each says how. "
             f"{html.escape(versions)}</p><nav>{nav}</nav>"]
    for card in sections:
        klass = "card headline" if card.number == 0 else "card"
        parts.append(f"<section class='{klass}' id='s{card.number}'><h2>{html.escape(card.title)}</h2>")
        if card.goals:
            parts.append("<ul>")
            for goal in card.goals:
                links = " ".join(f"<a href='{html.escape(_rel(l, out_dir))}'>evidence</a>" for l in goal.links)
                parts.append(f"<li><span class='badge' style='background:{BADGE[goal.status]}'>{goal.status}</span> "
                             f"<b>{goal.kind}</b>: {html.escape(goal.text)}<br><span class='how'>"
                             f"{html.escape(goal.evidence)}</span> {links}</li>")
            parts.append("</ul>")
        # The headline card is read whole; elsewhere long notes fold under their first sentence.
        parts += [f"<p>{html.escape(note)}</p>" if card.number == 0 else folded(note) for note in card.notes]
        for table in card.tables:
            # The frame scrolls a wide table inside the card; its first (key) column stays in view.
            parts.append(f"<h3>{html.escape(table.title)}</h3><div class='frame'>"
                         f"{key_columns_first(table.frame).to_html(index=False, border=0)}</div>"
                         f"{folded(table.how, css='how')}")
        for fig in card.figures:
            parts.append(f"<h3>{html.escape(fig.title)}</h3><img alt='{html.escape(fig.title)}' "
                         f"src='data:image/png;base64,{fig.png_b64}'>{folded(fig.how, css='how')}")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


# Markdown escaping, as html.escape is for the HTML page: every text a card carries may come
# from a results folder copied in from elsewhere. One line (no new list item, heading or forged
# verdict can start), and a backslash before every character that opens Markdown or HTML
# structure (emphasis, code, links and images, raw HTML and entities, table cells).
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&!{}$])")
_MD_LINE_START = re.compile(r"^([#>+=-]|\d+(?=[.)]))")


def md(text) -> str:
    """Any text as inert Markdown: shown as written, never as structure."""
    one_line = " ".join(str(text).split())
    escaped = _MD_SPECIAL.sub(r"\\\1", one_line)
    return _MD_LINE_START.sub(lambda m: m.group(1) + "\\" if m.group(1)[0].isdigit() else "\\" + m.group(1), escaped)


def md_link(path: str, out_dir: str) -> str:
    """An evidence link whose target is a percent-encoded relative path (never a scheme)."""
    return f"[evidence]({quote(_rel(path, out_dir))})"


def _table_markdown(frame) -> str:
    frame = frame.rename(columns=md).map(lambda v: md(v) if isinstance(v, str) else v)
    try:
        return frame.to_markdown(index=False)
    except ImportError:  # tabulate missing: still readable, each cell escaped
        return frame.to_string(index=False)


def render_markdown(sections: list[Card], summary: list[dict], out_dir: str, versions: str,
                    title: str = "distlab milestone report") -> str:
    lines = [f"# {title}", "",
             f"{len(summary)} run(s); open index.html for the plots. Every figure is measured by the pipeline. "
             f"{md(versions)}", ""]
    for card in sections:
        lines += [f"## {md(card.title)}", ""]
        for goal in card.goals:
            links = " ".join(md_link(l, out_dir) for l in goal.links)
            lines.append(f"- **{goal.status}** ({goal.kind}) {md(goal.text)}: {md(goal.evidence)} {links}".rstrip())
        lines.append("")
        for note in card.notes:
            lines += [md(note), ""]
        for table in card.tables:
            lines += [f"### {md(table.title)}", "", _table_markdown(table.frame), "", f"_{md(table.how)}_", ""]
        for fig in card.figures:
            lines += [f"- Figure in index.html: {md(fig.title)} ({md(fig.how)})", ""]
    return "\n".join(lines)
