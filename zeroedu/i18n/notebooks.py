"""The Chinese edition of the notebooks: one gettext catalogue per lesson, code shared with the English notebook.

    notebooks/NN_name.ipynb          the English lesson: the source of truth for code and for what to translate
    notebooks/zh/po/NN_name.po       one entry per English markdown cell: msgctxt = the cell id,
                                     msgid = the English text, msgstr = the Chinese text
    notebooks/zh/NN_name.ipynb       built from the two: never edited by hand

The exercises work the same way, from their solution notebooks (the source of exercises/ too):

    solutions/exNN_name.ipynb        the English solution, with its nbgrader metadata and hidden tests
    notebooks/zh/po/exNN_name.po     one entry per markdown cell of the solution, as above
    notebooks/zh/exercises/exNN_name.ipynb
                                     the Chinese exercise: the Chinese solution (English code, Chinese
                                     instructions) made into an exercise exactly as `zeroedu build-exercises`
                                     makes exercises/ from solutions/

The Chinese solution itself is built in memory and never saved: it holds the hidden tests, which must stay in
solutions/ (the grader hides that folder from learners' code), and any folder inside solutions/ or exercises/ is
a learner to `zeroedu grade FOLDER`. `zeroedu grade` grades a Chinese exercise against the English solution of the
same name: its graded cells carry the same nbgrader grade_ids, and its one extra cell (the language switch) is an
ungraded locked cell.

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
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
LANG_CELL_ID = "zeroedu-lang-zh"
LANG_CELL_SOURCE = 'import zeroedu\n\nzeroedu.lang("zh")  # 图表、控件和检查信息用中文'
# A relative link in an English cell points from notebooks/; the Chinese notebook sits one folder deeper.
_LINK = re.compile(r"(\]\(|href=\")(\.\./)")


def english_notebooks() -> list[Path]:
    """The lessons, in order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def solution_notebooks() -> list[Path]:
    """The exercises' solution notebooks, in order (each one generates an exercise)."""
    return sorted(SOLUTIONS.glob("ex[0-9][0-9]_*.ipynb"))


def is_solution(english: Path) -> bool:
    return english.parent.name == "solutions"


def po_path(english: Path) -> Path:
    """notebooks/zh/po/NAME.po, for a lesson and for an exercise's solution alike."""
    return PO / f"{english.stem}.po"


def zh_path(english: Path) -> Path:
    """Where the Chinese lesson is saved (a Chinese solution is never saved: see the module's docstring)."""
    return ZH / english.name


def zh_exercise_path(solution: Path) -> Path:
    """notebooks/zh/exercises/NAME.ipynb: the Chinese exercise a solution generates."""
    return ZH / "exercises" / solution.name


# An English exercise's relative link starts from exercises/, the Chinese one from notebooks/zh/exercises/.
_EXERCISE_LINK = re.compile(r"(\]\(|href=\")\.\./")


def localize_exercise_links(text: str) -> str:
    return _EXERCISE_LINK.sub(r"\1../../../", text)


def translated_notebooks() -> list[Path]:
    """The English lessons that have a Chinese catalogue (the edition grows lesson by lesson)."""
    return [nb for nb in english_notebooks() if po_path(nb).exists()]


def translated_solutions() -> list[Path]:
    """The solution notebooks that have a Chinese catalogue."""
    return [nb for nb in solution_notebooks() if po_path(nb).exists()]


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
                new.source = (localize_exercise_links if is_solution(english) else localize_links)(entry.msgstr)
        elif cell.cell_type == "code":
            old = saved.get(cell.id)
            if old is not None and old.source == cell.source:
                new.outputs, new.execution_count = old.outputs, old.execution_count
            else:
                new.outputs, new.execution_count = [], None
        cells.append(new)
    lang = nbformat.v4.new_code_cell(LANG_CELL_SOURCE, id=LANG_CELL_ID)
    lang.metadata["tags"] = ["zeroedu-lang", "remove-cell"]   # remove-cell: the book does not show it
    if is_solution(english):   # every code cell of an exercise is an nbgrader cell: this one is given, ungraded
        lang.metadata["nbgrader"] = {"grade": False, "grade_id": LANG_CELL_ID, "locked": True,
                                     "schema_version": 3, "solution": False, "task": False}
    old_lang = saved.get(LANG_CELL_ID)
    if old_lang is not None:
        lang.outputs, lang.execution_count = old_lang.outputs, old_lang.execution_count
    # after the lesson's title cell: below the hosted-setup cells (badges, setup), which must run before any import
    title = next((i for i, c in enumerate(cells) if c.cell_type == "markdown"
                  and "zeroedu-setup" not in c.metadata.get("tags", [])), -1)
    cells.insert(title + 1, lang)
    out = nbformat.v4.new_notebook(cells=cells, metadata=copy.deepcopy(en.metadata))
    out.metadata["zeroedu"] = {**out.metadata.get("zeroedu", {}), "language": "zh",
                               "english": f"../{english.name}" if not is_solution(english) else
                               f"../../../exercises/{english.name}"}
    out.nbformat, out.nbformat_minor = en.nbformat, en.nbformat_minor
    if is_solution(english):   # a solution's outputs are nbval's, on the English notebook; none are kept here
        for cell in out.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
    return out


def build_exercise(solution: Path, zh_solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The Chinese exercise: the Chinese solution with its answers stubbed and hidden tests removed, by the same
    function `zeroedu build-exercises` uses for exercises/."""
    from zeroedu.grading import notebook as nbtools  # imported here: the lessons' edition needs no grader

    nbtools.validate(zh_solution, f"the Chinese {solution.name}")
    return nbtools.to_exercise(zh_solution, f"solutions/{solution.name} + notebooks/zh/po/{solution.stem}.po")


def write(path: Path, nb: nbformat.NotebookNode) -> None:
    """Save as `zeroedu build-exercises` saves (so a rebuild with nothing changed writes the same bytes)."""
    from zeroedu.grading import notebook as nbtools

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbtools.write_text(nb), encoding="utf-8")


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
    if is_solution(english):
        zh = zh_exercise_path(english)
        status.built = zh.exists() and _sources(_read(zh)) == _sources(build_exercise(english, build(english)))
    else:
        zh = zh_path(english)
        status.built = zh.exists() and _sources(_read(zh)) == _sources(build(english))
    return status
