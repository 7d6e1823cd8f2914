"""The Chinese edition of the notebooks: one gettext catalogue per lesson, code shared with the English notebook.

    notebooks/NN_name.ipynb          the English lesson: the source of truth for code and for what to translate
    notebooks/zh/po/NN_name.po       one entry per English markdown cell: msgctxt = the cell id,
                                     msgid = the English text, msgstr = the Chinese text
    notebooks/zh/NN_name.ipynb       built from the two: never edited by hand

Why gettext: translators and their tools know .po files, `polib` reads and writes them, and a changed English cell
shows up the way gettext always shows it: its entry goes fuzzy with the previous English kept beside the new one, so
the translator sees exactly what moved. `check()` is what tests/test_translations.py asserts: no English cell without
a current translation, and no Chinese notebook whose cells are not exactly what `build()` makes (so its code equals the
English code, cell for cell).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import polib

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ZH = NOTEBOOKS / "zh"
PO = ZH / "po"
LANG_CELL_ID = "zeroedu-lang-zh"
LANG_CELL_SOURCE = 'import zeroedu\n\nzeroedu.lang("zh")  # 图表、控件和检查信息用中文'
# A relative link in an English cell points from notebooks/; the Chinese notebook sits one folder deeper.
_LINK = re.compile(r"(\]\(|href=\")(\.\./)")


def english_notebooks() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def po_path(english: Path) -> Path:
    return PO / f"{english.stem}.po"


def zh_path(english: Path) -> Path:
    return ZH / english.name


def translated_notebooks() -> list[Path]:
    """The English notebooks that have a Chinese catalogue (the edition grows lesson by lesson)."""
    return [nb for nb in english_notebooks() if po_path(nb).exists()]


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _markdown_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "markdown"]


def localize_links(text: str) -> str:
    """Rewrite the English cell's `../x` links for a notebook in notebooks/zh/."""
    return _LINK.sub(r"\1../\2", text)


def extract(english: Path) -> polib.POFile:
    """Create or update the catalogue of `english`, as msgmerge would: a changed cell goes fuzzy, keeping the
    previous English text; a removed cell's entry becomes obsolete; a new cell gets an empty entry."""
    path = po_path(english)
    po = polib.pofile(str(path)) if path.exists() else polib.POFile(wrapwidth=0)
    po.metadata = {"Project-Id-Version": f"zeroedu {english.stem}", "Language": "zh_CN",
                   "Content-Type": "text/plain; charset=utf-8", "Content-Transfer-Encoding": "8bit"}
    old = {e.msgctxt: e for e in po if not e.obsolete}
    entries = []
    for cell in _markdown_cells(_read(english)):
        entry = old.pop(cell.id, None)
        if entry is None:
            entry = polib.POEntry(msgctxt=cell.id, msgid=cell.source, msgstr="")
        elif entry.msgid != cell.source:
            entry.previous_msgid = entry.msgid
            entry.msgid = cell.source
            if entry.msgstr and "fuzzy" not in entry.flags:
                entry.flags.append("fuzzy")
        entries.append(entry)
    for entry in old.values():
        entry.obsolete = True
        entries.append(entry)
    new = polib.POFile(wrapwidth=0)
    new.metadata = po.metadata
    new.extend(entries)
    return new


def _current(po: polib.POFile) -> dict[str, polib.POEntry]:
    return {e.msgctxt: e for e in po if not e.obsolete}


def build(english: Path, previous: nbformat.NotebookNode | None = None) -> nbformat.NotebookNode:
    """The Chinese notebook for `english`: its cells with the markdown translated, the language cell after the
    first markdown cell, and the outputs of `previous` (the Chinese notebook as saved) kept for every code cell
    whose source did not change."""
    en = _read(english)
    entries = _current(polib.pofile(str(po_path(english))))
    saved = {c.id: c for c in previous.cells} if previous is not None else {}
    cells = []
    for cell in en.cells:
        new = copy.deepcopy(cell)
        if cell.cell_type == "markdown":
            entry = entries.get(cell.id)
            if entry is not None and entry.msgstr:
                new.source = localize_links(entry.msgstr)
        elif cell.cell_type == "code":
            old = saved.get(cell.id)
            if old is not None and old.source == cell.source:
                new.outputs, new.execution_count = old.outputs, old.execution_count
            else:
                new.outputs, new.execution_count = [], None
        cells.append(new)
    lang = nbformat.v4.new_code_cell(LANG_CELL_SOURCE, id=LANG_CELL_ID)
    lang.metadata["tags"] = ["zeroedu-lang", "remove-cell"]   # remove-cell: the book does not show it
    old_lang = saved.get(LANG_CELL_ID)
    if old_lang is not None:
        lang.outputs, lang.execution_count = old_lang.outputs, old_lang.execution_count
    # after the lesson's title cell: below the hosted-setup cells (badges, setup), which must run before any import
    title = next((i for i, c in enumerate(cells) if c.cell_type == "markdown"
                  and "zeroedu-setup" not in c.metadata.get("tags", [])), -1)
    cells.insert(title + 1, lang)
    out = nbformat.v4.new_notebook(cells=cells, metadata=copy.deepcopy(en.metadata))
    out.metadata["zeroedu"] = {"language": "zh", "english": f"../{english.name}"}
    out.nbformat, out.nbformat_minor = en.nbformat, en.nbformat_minor
    return out


@dataclass
class Status:
    notebook: str
    untranslated: list[str] = field(default_factory=list)   # cell ids with no Chinese text
    stale: list[str] = field(default_factory=list)          # English changed after the translation was written
    built: bool = True                                      # notebooks/zh/ holds exactly what build() makes

    @property
    def ok(self) -> bool:
        return not self.untranslated and not self.stale and self.built

    def describe(self) -> str:
        if self.ok:
            return f"{self.notebook}: up to date"
        parts = []
        if self.stale:
            parts.append(f"{len(self.stale)} cell(s) changed in English after translation ({', '.join(self.stale)})")
        if self.untranslated:
            parts.append(f"{len(self.untranslated)} cell(s) not translated ({', '.join(self.untranslated)})")
        if not self.built:
            parts.append("notebooks/zh/ differs from the catalogue: run `python -m zeroedu.i18n build`")
        return f"{self.notebook}: " + "; ".join(parts)


def _sources(nb: nbformat.NotebookNode) -> list[tuple[str, str, str]]:
    return [(c.cell_type, c.get("id", ""), c.source) for c in nb.cells]


def check(english: Path) -> Status:
    """What is out of step between `english`, its catalogue and its Chinese notebook."""
    status = Status(english.name)
    entries = _current(polib.pofile(str(po_path(english))))
    for cell in _markdown_cells(_read(english)):
        entry = entries.get(cell.id)
        if entry is None or (not entry.msgstr and entry.msgid == cell.source):
            status.untranslated.append(cell.id)
        elif entry.msgid != cell.source or "fuzzy" in entry.flags:
            status.stale.append(cell.id)
    zh = zh_path(english)
    status.built = zh.exists() and _sources(_read(zh)) == _sources(build(english))
    return status
