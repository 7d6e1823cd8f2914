"""Build reveal.js slide decks from the lessons' saved outputs: `make slides`.

    python scripts/build_slides.py                       # every lesson, English and 中文, into build/slides/
    python scripts/build_slides.py --lesson 01 05        # only these lessons
    python scripts/build_slides.py --reveal-prefix reveal.js   # load reveal.js from a local copy (offline room)

For each lesson notebook `notebooks/NN_*.ipynb`, and its Chinese edition `notebooks/zh/NN_*.ipynb` where one
exists, this writes a deck notebook `build/slides/<lang>/NN_*.ipynb` and its HTML `NN_*.slides.html`:

- a title slide: the lesson's H1 and its goal line;
- one slide per saved figure (an image/png output of a code cell), titled with the heading of the section the
  figure came from;
- the Summary (小结) as the last slide, one slide per markdown cell under that heading.

Nothing is executed: the decks show the outputs saved in the notebooks, so they are as fresh as the last
`nbval` run. The HTML is nbconvert's SlidesExporter (reveal.js) with the code inputs left out. By default
nbconvert loads reveal.js, jQuery and require.js from a CDN; `--reveal-prefix` points reveal.js at a local
copy (the unpacked npm package `reveal.js@4`, so `<prefix>/dist/reveal.js` exists), which an offline room
needs, together with local jQuery and require.js (`--jquery-url`, `--require-js-url`).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbconvert import SlidesExporter

ROOT = Path(__file__).resolve().parents[1]
LESSON = re.compile(r"^\d\d_.*\.ipynb$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# The Summary heading in each edition (docs/zh/style.md: a Summary is "## 小结").
SUMMARY = {"Summary", "小结"}
CHINESE_COPY = re.compile(r"^#{3,6}\s+中文.*$", re.M)
# The goal line is the first bold-led paragraph of the title cell ("**Goal:** ...", "**目标：** ...").
GOAL = re.compile(r"^\*\*(Goal|目标|Prerequisites|前置)")


class SlidesError(ValueError):
    """A lesson notebook that cannot become a deck; the message names the notebook and the fix."""


@dataclass
class Lesson:
    path: Path
    title: str
    goal: str
    figures: list[tuple[str, dict]] = field(default_factory=list)  # (section heading, image/png output)
    summary: list[str] = field(default_factory=list)  # markdown sources, heading included in the first


def headings(source: str) -> list[tuple[int, str]]:
    """(level, text) of each markdown heading line, skipping fenced code."""
    found, fenced = [], False
    for line in source.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def by_h2(source: str) -> list[str]:
    """`source` cut before each '## ' heading line (outside fenced code): a section's text per part."""
    parts, current, fenced = [], [], False
    for line in source.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## ") and current:
            parts.append("\n".join(current))
            current = []
        current.append(line)
    parts.append("\n".join(current))
    return parts


def read_lesson(path: Path) -> Lesson:
    """Pick the title, goal, figures and summary out of a lesson notebook's saved cells."""
    nb = nbformat.read(path, as_version=4)
    # the hosted-setup cells at the top (badges, setup: scripts/setup_cell.py) are not part of the lesson
    nb.cells = [c for c in nb.cells if "zeroedu-setup" not in c.metadata.get("tags", [])]
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    h1 = [t for lvl, t in headings(first.source) if lvl == 1] if first else []
    if not h1:
        raise SlidesError(f"{path}: the first markdown cell has no '# title' heading; a lesson starts with its H1")
    paragraphs = [p.strip() for p in first.source.split("\n\n") if p.strip() and not p.lstrip().startswith("#")]
    goal = next((p for p in paragraphs if GOAL.match(p)), paragraphs[0] if paragraphs else "")
    lesson = Lesson(path, h1[0], goal)

    section, in_summary = h1[0], False
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            # A cell may hold the end of one section and the start of the next: split it at its H2s.
            kept = []
            for part in by_h2(cell.source):
                h2 = [t for lvl, t in headings(part) if lvl == 2]
                if h2:
                    in_summary = h2[0] in SUMMARY
                # The English summary carries a Chinese copy under "### 中文 小结"; it belongs in the 中文 deck.
                part = CHINESE_COPY.split(part)[0].strip()
                if in_summary and part:
                    kept.append(part)
            if kept:
                lesson.summary.append("\n\n".join(kept))
            found = [t for lvl, t in headings(cell.source) if lvl >= 2]
            if found:
                section = found[-1]
        elif cell.cell_type == "code":
            for out in cell.get("outputs", []):
                if "image/png" in out.get("data", {}):
                    lesson.figures.append((section, out))
    if not lesson.summary:
        raise SlidesError(f"{path}: no '## Summary' (or '## 小结') section; every lesson ends with one, "
                          "and the deck's last slide is built from it")
    return lesson


def slide(cell: nbformat.NotebookNode, kind: str = "slide") -> nbformat.NotebookNode:
    cell.metadata["slideshow"] = {"slide_type": kind}
    return cell


def deck(lesson: Lesson) -> nbformat.NotebookNode:
    """A notebook whose cells are the slides: title, one per figure, then the summary."""
    v4 = nbformat.v4
    cells = [slide(v4.new_markdown_cell(f"# {lesson.title}\n\n{lesson.goal}"))]
    for heading, out in lesson.figures:
        cells.append(slide(v4.new_markdown_cell(f"## {heading}")))
        # Only the PNG travels: a widget output's saved PNG is its static picture, and the widget itself
        # would need a kernel.
        image = v4.new_output("display_data", data={"image/png": out["data"]["image/png"]},
                              metadata={k: v for k, v in out.get("metadata", {}).items() if k == "image/png"})
        cells.append(slide(v4.new_code_cell("", outputs=[image]), "-"))
    cells += [slide(v4.new_markdown_cell(src)) for src in lesson.summary]
    nb = v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["zeroedu"] = {"slides_from": lesson.path.name}
    return nb


def export(nb: nbformat.NotebookNode, target: Path, reveal_prefix: str | None = None,
           jquery_url: str | None = None, require_js_url: str | None = None) -> Path:
    exporter = SlidesExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    if reveal_prefix:
        exporter.reveal_url_prefix = reveal_prefix
    if jquery_url:
        exporter.jquery_url = jquery_url
    if require_js_url:
        exporter.require_js_url = require_js_url
    html, _ = exporter.from_notebook_node(nb)
    target.write_text(html, encoding="utf-8")
    return target


def lessons(notebooks: Path, only: list[str] | None = None) -> list[Path]:
    """Lesson notebooks NN_*.ipynb in `notebooks`, optionally only those whose number is in `only`."""
    found = sorted(p for p in notebooks.glob("*.ipynb") if LESSON.match(p.name))
    return [p for p in found if not only or p.name[:2] in only]


def build(notebooks: Path, out: Path, only: list[str] | None = None, **export_args: str | None) -> list[Path]:
    """Write the decks of every lesson (English, and 中文 from notebooks/zh/ where it exists); return the HTML paths."""
    editions = [("en", notebooks), ("zh", notebooks / "zh")]
    if only:
        missing = sorted(set(only) - {p.name[:2] for p in lessons(notebooks)})
        if missing:
            raise SlidesError(f"no lesson notebook numbered {', '.join(missing)} in {notebooks}")
    written = []
    for lang, folder in editions:
        paths = lessons(folder, only) if folder.is_dir() else []
        if paths:
            (out / lang).mkdir(parents=True, exist_ok=True)
        for path in paths:
            nb = deck(read_lesson(path))
            nbformat.write(nb, out / lang / path.name)
            written.append(export(nb, out / lang / f"{path.stem}.slides.html", **export_args))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="lesson notebooks")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "slides", help="where decks go")
    parser.add_argument("--lesson", nargs="*", default=None, help="lesson numbers (01 05 ...); default all")
    parser.add_argument("--reveal-prefix", default=None, help="local reveal.js 4 folder or URL (default: CDN)")
    parser.add_argument("--jquery-url", default=None, help="local jquery.min.js (default: CDN)")
    parser.add_argument("--require-js-url", default=None, help="local require.min.js (default: CDN)")
    args = parser.parse_args(argv)
    try:
        written = build(args.notebooks, args.out, args.lesson, reveal_prefix=args.reveal_prefix,
                        jquery_url=args.jquery_url, require_js_url=args.require_js_url)
    except SlidesError as e:
        print(f"build_slides: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
