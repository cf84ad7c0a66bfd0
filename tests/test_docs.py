"""The README is a page of use with the rest under docs/: it stays short, every relative link
of the README, docs/ and benchmarks/RESULTS.md reaches a file that exists (and a heading there
when it names one), and the user's pages keep no development history."""
from __future__ import annotations

import re
from collections import Counter

from conftest import REPO

README_MAX_LINES = 300
USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED_PAGES = [*USER_PAGES, REPO / "benchmarks" / "RESULTS.md"]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans removed."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return re.sub(r"`[^`]*`", "", "\n".join(lines))


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ..."""
    anchors, seen = set(), Counter()
    for line in prose(text.replace("`", "")).splitlines():
        match = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


def test_the_readme_is_at_most_300_lines_with_its_topics_under_docs():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, more than {README_MAX_LINES}"
    assert len(USER_PAGES) > 1, "no page under docs/"


def test_every_relative_link_of_the_readme_and_docs_points_to_a_file_that_exists():
    broken = []
    for page in LINKED_PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if EXTERNAL.match(target):
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not linked.exists():
                broken.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_user_docs_keep_no_development_history():
    """Dated lab-log passages and development steps live in benchmarks/RESULTS.md; a page of
    use states facts in the present tense and links there for a measured figure."""
    history = re.compile(r"\b(?:stop|issue) \d+\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
    found = [f"{page.relative_to(REPO)}: {line.strip()}"
             for page in USER_PAGES
             for line in prose(page.read_text()).splitlines()
             if history.search(LINK.sub("", line))]
    assert not found, "development history in the user docs:\n" + "\n".join(found)
