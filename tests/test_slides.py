"""`make slides`: the reveal.js decks built from the lessons' saved outputs (scripts/build_slides.py).

The expected titles, figure counts, images and summaries are read here from the lesson notebooks themselves,
not from the script, and compared with what a browser would get: the slides (innermost <section>s) of the HTML.
"""

from __future__ import annotations

import html
import importlib.util
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ["01", "02"]


def load_script():
    spec = importlib.util.spec_from_file_location("build_slides", ROOT / "scripts" / "build_slides.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module


class Slides(HTMLParser):
    """Collect the raw HTML of each innermost <section> (one reveal.js slide) in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.stack: list[list[str]] = []
        self.has_child: list[bool] = []
        self.slides: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "section":
            if self.has_child:
                self.has_child[-1] = True
            self.stack.append([])
            self.has_child.append(False)
        elif self.stack:
            self.stack[-1].append(self.get_starttag_text())

    def handle_endtag(self, tag):
        if tag == "section":
            body, nested = self.stack.pop(), self.has_child.pop()
            if not nested:
                self.slides.append("".join(body))
            if self.stack:
                self.stack[-1].append("".join(body))
        elif self.stack:
            self.stack[-1].append(f"</{tag}>")

    def handle_data(self, data):
        if self.stack:
            self.stack[-1].append(data)

    def handle_entityref(self, name):
        self.handle_data(f"&{name};")

    def handle_charref(self, name):
        self.handle_data(f"&#{name};")


def slides_of(path: Path) -> list[str]:
    parser = Slides()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser.slides


def text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", fragment))


def saved_pngs(nb) -> list[str]:
    return [out["data"]["image/png"].replace("\n", "") for c in nb.cells if c.cell_type == "code"
            for out in c.get("outputs", []) if "image/png" in out.get("data", {})]


def summary_cell(nb, heading: str) -> str:
    return next(c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith(f"## {heading}"))


@pytest.fixture(scope="module")
def decks(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    written = load_script().build(ROOT / "notebooks", out, LESSONS)
    return out, written


def lesson_paths(lang: str) -> list[Path]:
    folder = ROOT / "notebooks" / ("zh" if lang == "zh" else "")
    return sorted(p for n in LESSONS for p in folder.glob(f"{n}_*.ipynb"))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_each_deck_has_title_every_saved_figure_and_summary(decks, lang):
    out, written = decks
    sources = lesson_paths(lang)
    assert len(sources) == len(LESSONS), f"expected lessons {LESSONS} in notebooks/{lang}"
    for src in sources:
        deck = out / lang / f"{src.stem}.slides.html"
        assert deck in written and deck.is_file()
        nb = nbformat.read(src, as_version=4)
        slides = slides_of(deck)

        title = next(c for c in nb.cells if c.cell_type == "markdown"   # below the hosted-setup cells
                     and "zeroedu-setup" not in c.metadata.get("tags", []))
        h1 = title.source.splitlines()[0].removeprefix("# ").strip()
        assert h1 in text(slides[0]), f"{deck.name}: first slide lacks the title {h1!r}"

        pngs = saved_pngs(nb)
        assert pngs, f"{src} has no saved figure: pick lessons with figures for this test"
        with_image = [s for s in slides if 'src="data:image/png;base64,' in s]
        assert len(with_image) == len(pngs), f"{deck.name}: {len(with_image)} figure slides, {len(pngs)} figures"
        embedded = [re.search(r'src="data:image/png;base64,([^"]+)"', s).group(1) for s in with_image]
        assert embedded == pngs, f"{deck.name}: the slides' images are not the notebook's, in order"
        assert all(s.count("data:image/png;base64,") == 1 for s in with_image), "one figure per slide"

        heading = "小结" if lang == "zh" else "Summary"
        last = text(slides[-1])
        assert heading in last, f"{deck.name}: the last slide is not the {heading}"
        # The first numbered point of the notebook's own summary, as plain text.
        point = next(line for line in summary_cell(nb, heading).splitlines() if line.startswith("1. "))
        words = re.sub(r"[*`]", "", point[3:])[:20]
        assert words in " ".join(last.split()), f"{deck.name}: summary slide lacks {words!r}"
        if lang == "en":  # the English notebook's summary ends with a Chinese copy, left to the 中文 deck
            assert "中文" not in last and "小结" not in last, f"{deck.name}: the English summary slide has Chinese"


def test_chinese_deck_summary_is_the_chinese_one(decks):
    out, _ = decks
    for src in lesson_paths("zh"):
        last = text(slides_of(out / "zh" / f"{src.stem}.slides.html")[-1])
        assert "小结" in last and "Summary" not in last
        english = nbformat.read(ROOT / "notebooks" / src.name, as_version=4)
        first_en = next(line for line in summary_cell(english, "Summary").splitlines() if line.startswith("1. "))
        assert re.sub(r"[*`]", "", first_en[3:])[:20] not in last


def test_summary_sharing_a_cell_with_the_previous_section(tmp_path):
    md = nbformat.v4.new_markdown_cell
    nb = nbformat.v4.new_notebook(cells=[
        md("# 98 · A lesson\n\n**Goal:** one summary point"),
        md("## 3. Last section\n\nsection text\n\n## Summary\n\n1. the point\n\n### 中文 小结\n\n1. 要点"),
        md("## Check your understanding\n\n1. a question"),
    ])
    (tmp_path / "98_x.ipynb").write_text(nbformat.writes(nb), encoding="utf-8")
    out = tmp_path / "out"
    load_script().build(tmp_path, out)
    last = text(slides_of(out / "en" / "98_x.slides.html")[-1])
    assert "the point" in last
    assert "section text" not in last and "要点" not in last and "a question" not in last


def test_lesson_without_summary_is_refused_with_the_fix(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · A lesson\n\n**Goal:** none")])
    (tmp_path / "99_x.ipynb").write_text(nbformat.writes(nb), encoding="utf-8")
    script = load_script()
    with pytest.raises(script.SlidesError, match=r"99_x\.ipynb.*## Summary"):
        script.build(tmp_path, tmp_path / "out")
