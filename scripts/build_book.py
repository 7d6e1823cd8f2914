"""Build the course book: a static HTML site in English and 中文 from the notebooks' saved outputs (`make book`).

    python scripts/build_book.py [--out build/book] [--pdf]

For each language it stages a Sphinx source tree (build/book-src/LANG/: index, the lessons, the exercises, the
glossary and the cheat sheet, keeping the repository's notebooks/ and exercises/ folders so that the lessons' own
relative links resolve) and runs sphinx-build with docs/book/conf.py. No notebook is executed. A lesson without a
Chinese edition yet appears in the Chinese book in English, under a note that says so, so that every page exists in
both languages and the language switch always lands on the same lesson. `--pdf` prints each cheat sheet to PDF
with headless Chromium (build/book/cheatsheet.en.pdf, cheatsheet.zh.pdf).

Open build/book/index.html in a browser; it forwards to the English book.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeroedu.i18n import notebooks as ed  # noqa: E402

CONF = ROOT / "docs" / "book"
LANGS = {"en": "en", "zh": "zh_CN"}
CHROMIUM = os.environ.get("ZEROEDU_CHROMIUM", "/usr/bin/chromium")

INDEX = {
    "en": """# zeroedu: learn DeepSpeed ZeRO by running it

This is the course as a book: every lesson with the outputs it saved when it last ran, so you can read first and
run later. Every number here was measured on live ranks (processes talking over gloo) and printed next to its
closed-form theory. To run the lessons yourself, clone the repository and follow its README (`make tour`), or open
a lesson in a hosted notebook.

<a href="../zh/index.html">中文版</a> · [Glossary](glossary.md) · [Cheat sheet](cheatsheet.md)
""",
    "zh": """# zeroedu：边跑边学 DeepSpeed ZeRO

这是课程的书籍版：每一课都附带它上次运行时保存的输出，可以先读后跑。
书中每个数字都是在真实的 rank（通过 gloo 通信的进程）上实测的，
并与闭式理论值并排列出。想自己运行，请克隆仓库并按 README 操作（`make tour`），或在托管的 notebook 环境中打开某一课。

<a href="../en/index.html">English</a> · [术语表](glossary.md) · [速查表](cheatsheet.md)
""",
}
TOC_CAPTIONS = {"en": ("Lessons", "Exercises", "Reference"), "zh": ("课程", "练习", "参考")}
PENDING = {"zh": '<div class="zeroedu-pending">本页的中文版尚在翻译中，以下为英文原文。</div>'}
GLOSSARY_TITLE = {"en": "# Glossary · 术语表", "zh": "# 术语表 · Glossary"}


def glossary() -> str:
    """The glossary section of notebooks/README.md (one table, both languages), as its own page."""
    text = (ROOT / "notebooks" / "README.md").read_text(encoding="utf-8")
    start = text.index("## Glossary")
    body = text[start:].split("\n", 1)[1]
    nxt = re.search(r"^## ", body, flags=re.M)
    return body[: nxt.start()] if nxt else body


def _without_setup(nb: dict) -> dict:
    """The hosted-setup code cell (scripts/setup_cell.py) installs the course on Colab; a reader of the book has
    nothing to install, so the book keeps the badges above it and leaves the cell out."""
    nb["cells"] = [c for c in nb["cells"] if not (c["cell_type"] == "code"
                                                  and "zeroedu-setup" in c.get("metadata", {}).get("tags", []))]
    return nb


def _copy(src: Path, dst: Path) -> None:
    nb = _without_setup(json.loads(src.read_text(encoding="utf-8")))
    dst.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")


def _pending_copy(src: Path, dst: Path, lang: str) -> None:
    nb = _without_setup(json.loads(src.read_text(encoding="utf-8")))
    nb["cells"].insert(0, {"cell_type": "markdown", "id": "zeroedu-pending", "metadata": {},
                           "source": PENDING[lang]})
    dst.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")


def _unlocalize(src: Path, dst: Path, deeper: str = r"\.\./\.\./") -> None:
    """A Chinese notebook staged at notebooks/NAME (or exercises/NAME): its links were written for notebooks/zh/
    (or notebooks/zh/exercises/), one folder (or two) deeper."""
    nb = _without_setup(json.loads(src.read_text(encoding="utf-8")))
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            cell["source"] = re.sub(r"(\]\(|href=\")" + deeper, r"\1../", text)
    dst.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")


def stage(lang: str, src: Path) -> None:
    if src.exists():
        shutil.rmtree(src)
    (src / "notebooks").mkdir(parents=True)
    (src / "exercises").mkdir()
    lessons = ed.english_notebooks()
    for nb in lessons:
        dst = src / "notebooks" / nb.name
        if lang == "en":
            _copy(nb, dst)
        elif ed.zh_path(nb).exists():
            _unlocalize(ed.zh_path(nb), dst)
        else:
            _pending_copy(nb, dst, lang)
    exercises = sorted((ROOT / "exercises").glob("ex*.ipynb"))
    for ex in exercises:
        zh_ex = ed.zh_exercise_path(ROOT / "solutions" / ex.name)   # built by `python -m zeroedu.i18n build`
        if lang == "en":
            _copy(ex, src / "exercises" / ex.name)
        elif zh_ex.exists():
            _unlocalize(zh_ex, src / "exercises" / ex.name, r"\.\./\.\./\.\./")
        else:
            _pending_copy(ex, src / "exercises" / ex.name, lang)
    (src / "glossary.md").write_text(GLOSSARY_TITLE[lang] + "\n" + glossary(), encoding="utf-8")
    sheet = ROOT / "docs" / ("cheatsheet.zh.md" if lang == "zh" else "cheatsheet.md")
    shutil.copy(sheet, src / "cheatsheet.md")
    lessons_cap, ex_cap, ref_cap = TOC_CAPTIONS[lang]
    toc = [INDEX[lang], "", f"```{{toctree}}\n:caption: {lessons_cap}\n:maxdepth: 1\n",
           *[f"notebooks/{nb.stem}" for nb in lessons], "```", "",
           f"```{{toctree}}\n:caption: {ex_cap}\n:maxdepth: 1\n", *[f"exercises/{ex.stem}" for ex in exercises],
           "```", "", f"```{{toctree}}\n:caption: {ref_cap}\n:maxdepth: 1\n", "glossary", "cheatsheet", "```", ""]
    (src / "index.md").write_text("\n".join(toc), encoding="utf-8")


def build(out: Path, langs: list[str]) -> None:
    for lang in langs:
        src = ROOT / "build" / "book-src" / lang
        stage(lang, src)
        env = {**os.environ, "ZEROEDU_BOOK_LANG": lang, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(CONF), "-D",
               f"language={LANGS[lang]}", str(src), str(out / lang)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"sphinx-build failed for the {lang} book (above)")
        warnings = [w for w in proc.stderr.splitlines() if "WARNING" in w]
        print(f"{out / lang}/index.html" + (f" ({len(warnings)} warnings)" if warnings else ""))
        for w in warnings[:20]:
            print("  " + w)
    (out / "index.html").write_text('<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" '
                                    'content="0; url=en/index.html"><a href="en/index.html">zeroedu</a>\n',
                                    encoding="utf-8")


def pdf(out: Path) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        raise SystemExit(f"--pdf prints with Chromium, and {CHROMIUM} is not there: run "
                         "`sudo bash scripts/install_chromium.sh` or set ZEROEDU_CHROMIUM")
    for lang in LANGS:
        page = (out / lang / "cheatsheet.html").resolve()
        target = (out / f"cheatsheet.{lang}.pdf").resolve()
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--no-pdf-header-footer",
                        f"--print-to-pdf={target}", page.as_uri()], check=True, capture_output=True, timeout=120)
        print(target.relative_to(ROOT) if target.is_relative_to(ROOT) else target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "book")
    ap.add_argument("--lang", nargs="*", choices=list(LANGS), default=list(LANGS))
    ap.add_argument("--pdf", action="store_true", help="also print the cheat sheets to PDF (Chromium)")
    args = ap.parse_args(argv)
    build(args.out, args.lang)
    if args.pdf:
        pdf(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
