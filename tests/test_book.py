"""The course book (`make book`, scripts/build_book.py), opened in a real browser: a lesson page in each language
shows its figures, the language switch leads to the same lesson in the other language, search finds a term in each
language, and no page of either book has a broken internal link. The cheat sheets print to PDF.

The book is built once into a temp folder from this checkout's saved outputs (no notebook runs) and served by
Python's http.server on 127.0.0.1 (a random port); the browser is Debian's chromium driven by playwright, as in
tests/test_browser.py.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("ZEROEDU_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LESSON_WITH_FIGURES = "notebooks/01_memory_anatomy.html"
TRANSLATED_LESSON = "notebooks/00_start_here.html"


def _missing() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM}: run scripts/install_chromium.sh (as root) or set ZEROEDU_CHROMIUM"
    try:
        import myst_nb  # noqa: F401
        import playwright.sync_api  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed: pip install -e '.[test]'"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> Path:
    reason = _missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the book test: {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("book")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_book.py"), "--out", str(out), "--pdf"],
                   check=True, cwd=ROOT, timeout=800)
    return out


@pytest.fixture(scope="module")
def server(book):
    handler = functools.partial(_QuietHandler, directory=str(book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser.new_page()
        browser.close()


def _figures_loaded(page) -> list[int]:
    """Widths of the lesson's own figures (saved outputs, served from the book); the badges at the top of every
    lesson point at Colab's and ModelScope's servers, which a machine without internet cannot load."""
    return page.eval_on_selector_all(
        "article img", "imgs => imgs.filter(i => !/^https?:/.test(i.getAttribute('src') || ''))"
                       ".map(i => i.complete ? i.naturalWidth : 0)")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_lesson_shows_its_figures(page, server, lang):
    page.goto(f"{server}/{lang}/{LESSON_WITH_FIGURES}")
    page.wait_for_load_state("load")
    widths = _figures_loaded(page)
    assert widths and all(w > 0 for w in widths), f"{lang}: figures that did not load: {widths}"


def test_the_language_switch_leads_to_the_same_lesson(page, server):
    page.goto(f"{server}/en/{TRANSLATED_LESSON}")
    assert "Start here" in page.inner_text("h1")
    page.click("#zeroedu-langswitch")
    page.wait_for_load_state("load")
    assert page.url.endswith(f"/zh/{TRANSLATED_LESSON}")
    assert "从这里开始" in page.inner_text("h1")
    page.click("#zeroedu-langswitch")
    page.wait_for_load_state("load")
    assert page.url.endswith(f"/en/{TRANSLATED_LESSON}")


# a term each language's book has on one lesson only ("课程地图": lesson 00's map of the course), and one that many
# lessons share, so the expected lesson must be among several results
@pytest.mark.parametrize(("lang", "term", "expect"), [("en", "reduce-scatter", "Collectives"),
                                                      ("zh", "课程地图", "从这里开始")])
def test_search_finds_a_term(page, server, lang, term, expect):
    page.goto(f"{server}/{lang}/search.html?q={term}")
    page.wait_for_selector("ul.search li", timeout=60_000)
    results = page.inner_text("ul.search")
    assert expect in results, results[:500]


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        for name, value in attrs:
            if value and ((tag == "a" and name == "href") or (tag in ("img", "script") and name == "src")
                          or (tag == "link" and name == "href")):
                self.targets.append(value)


def test_no_broken_internal_link(book):
    pages = sorted(p for p in book.rglob("*.html") if "_static" not in p.relative_to(book).parts)
    assert len(pages) > 40
    broken = []
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for target in parser.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            resolved = (page.parent / unquote(parts.path)).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(book)} -> {target}")
    assert not broken, "\n".join(broken[:30])


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_cheat_sheet_pdf(book, lang):
    pdf = book / f"cheatsheet.{lang}.pdf"
    assert pdf.read_bytes()[:5] == b"%PDF-"
    if shutil.which("pdftotext"):
        text = subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True, check=True).stdout
        assert ("速查表" if lang == "zh" else "cheat sheet") in text and "14.0" in text
