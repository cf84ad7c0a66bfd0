"""The report in a real browser: headless Chromium (Debian's `chromium` package) loads the
page without console errors, every embedded plot decodes, and a screenshot is taken.

Chromium missing is a failure, not a skip: CI installs it (apt-get install -y chromium).
"""
from __future__ import annotations

import html as html_lib
import json
import re
import shutil
import subprocess

import pytest

pytest_plugins = ["report_fixtures"]

# Injected into a COPY of the page (the report itself has no script): records every error
# event (script errors and failed resource loads, captured) and console.error/warn call,
# then decodes each image (canvas draw) and writes the verdict into the DOM for --dump-dom.
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || (e.target && e.target.src) || e)), true);
for (const level of ['error', 'warn']) {
  const original = console[level];
  console[level] = (...args) => { window.__errors.push(level + ': ' + args.join(' ')); original(...args); };
}
window.addEventListener('load', () => {
  // Drawing each image onto a canvas and reading a pixel forces a full decode, synchronously,
  // so the verdict is in the DOM before --dump-dom prints it.
  const images = [];
  for (const img of document.images) {
    let ok = img.complete && img.naturalWidth > 0;
    try {
      const canvas = document.createElement('canvas');
      canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
      const ctx = canvas.getContext('2d');
      ctx.drawImage(img, 0, 0);
      ctx.getImageData(0, 0, 1, 1);
    } catch (e) { ok = false; }
    images.push({alt: img.alt, ok: ok, width: img.naturalWidth});
  }
  // A card wider than its box overflows the page: wide tables must scroll inside their frame.
  const overflowing = [];
  for (const card of document.querySelectorAll('section.card')) {
    if (card.scrollWidth > card.clientWidth + 1)
      overflowing.push(card.id + ' ' + card.scrollWidth + '>' + card.clientWidth);
  }
  // A table wider than the card scrolls inside its frame and keeps its first (key) column in view.
  const unframed = [];
  for (const table of document.querySelectorAll('section.card table')) {
    const box = table.closest('.frame') || table;
    const first = table.querySelector('th, td');
    if (box.scrollWidth > box.clientWidth + 1
        && !(box !== table && first && getComputedStyle(first).position === 'sticky')) {
      unframed.push((table.closest('section') || {}).id + ': ' + (first ? first.textContent : ''));
    }
  }
  const out = document.createElement('pre');
  out.id = 'distlab-probe';
  out.textContent = JSON.stringify({errors: window.__errors, images: images, overflowing: overflowing,
                                    unframed: unframed,
                                    page: [document.documentElement.scrollWidth, window.innerWidth]});
  document.body.appendChild(out);
});
</script>"""


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("headless Chromium is required for the report's browser test: apt-get install -y chromium")


def chromium(*args, timeout=120):
    cmd = [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_report_loads_in_chromium_without_errors_and_every_plot_decodes(finished_pipeline, tmp_path):
    work, _ = finished_pipeline
    page = work / "results" / "report" / "index.html"
    html = page.read_text()
    probed = page.with_name("probed-copy.html")  # same folder: relative evidence links resolve alike
    probed.write_text(html.replace("<head>", "<head>" + PROBE, 1))
    try:
        proc = chromium("--virtual-time-budget=10000", "--window-size=1400,1000", "--dump-dom", probed.as_uri())
    finally:
        probed.unlink()
    found = re.search(r'<pre id="distlab-probe">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"the page never finished loading in Chromium:\n{proc.stderr[-2000:]}"
    probe = json.loads(html_lib.unescape(found.group(1)))
    assert probe["errors"] == []
    # At 1400 px no card is wider than its box, and the page does not scroll sideways.
    assert probe["overflowing"] == [], probe["overflowing"]
    assert probe["page"][0] <= probe["page"][1], probe["page"]
    assert probe["unframed"] == [], probe["unframed"]
    assert len(probe["images"]) == html.count("<img ") >= 4
    assert all(img["ok"] for img in probe["images"]), [img for img in probe["images"] if not img["ok"]]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []

    # A phone-sized screenshot of the untouched page, kept in this test's tmp dir.
    shot = tmp_path / "report-phone.png"
    proc = chromium("--window-size=412,1800", f"--screenshot={shot}", page.as_uri())
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr[-2000:]
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank image
