"""The Chinese edition never goes stale: each translated lesson's catalogue matches its English cells, and its
notebook in notebooks/zh/ is exactly what the catalogue builds (so its code cells are the English code cells)."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polib
import pytest

from zeroedu import i18n
from zeroedu.i18n import notebooks as ed

ROOT = Path(__file__).resolve().parents[1]
TRANSLATED = ed.translated_notebooks()


def test_the_edition_has_lessons():
    assert TRANSLATED, "no lesson has a Chinese catalogue in notebooks/zh/po/"


@pytest.mark.parametrize("english", TRANSLATED, ids=lambda p: p.stem)
def test_translation_is_current(english):
    status = ed.check(english)
    assert status.ok, status.describe() + " (python -m zeroedu.i18n status; docs/zh/style.md says how to update)"


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("english", TRANSLATED, ids=lambda p: p.stem)
def test_code_cells_are_the_english_ones(english):
    """Read straight from the two files: the Chinese notebook's code, minus its one language cell, is the English
    code, cell for cell, and every markdown cell of the Chinese notebook is a translation (not the English text)."""
    en, zh = _cells(english), _cells(ed.zh_path(english))
    lang = [c for c in zh if "zeroedu-lang" in c.get("metadata", {}).get("tags", [])]
    assert len(lang) == 1 and "zeroedu.lang(\"zh\")" in "".join(lang[0]["source"])
    zh = [c for c in zh if c is not lang[0]]
    assert [(c["cell_type"], "".join(c["source"])) for c in en if c["cell_type"] == "code"] == \
        [(c["cell_type"], "".join(c["source"])) for c in zh if c["cell_type"] == "code"]
    for e, z in zip(en, zh, strict=True):
        if e["cell_type"] == "markdown":
            assert "".join(z["source"]) != "".join(e["source"]), f"cell {e['id']} is not translated"


def _copy_lesson(tmp_path: Path, english: Path) -> Path:
    """A scratch course tree with one lesson and its Chinese edition, so that the test can edit the English."""
    root = tmp_path / "course"
    (root / "notebooks" / "zh" / "po").mkdir(parents=True)
    shutil.copy(english, root / "notebooks" / english.name)
    shutil.copy(ed.po_path(english), root / "notebooks" / "zh" / "po" / ed.po_path(english).name)
    shutil.copy(ed.zh_path(english), root / "notebooks" / "zh" / english.name)
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from pathlib import Path; from zeroedu.i18n import notebooks as ed, __main__ as m; "
            f"r = Path({str(root)!r}); ed.ROOT, ed.NOTEBOOKS, ed.ZH, ed.PO = r, r/'notebooks', r/'notebooks'/'zh', "
            "r/'notebooks'/'zh'/'po'; sys.exit(m.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_a_changed_english_cell_is_caught_and_goes_fuzzy(tmp_path):
    english = TRANSLATED[0]
    root = _copy_lesson(tmp_path, english)
    assert _run(root, "status").returncode == 0
    nb = json.loads((root / "notebooks" / english.name).read_text())
    md = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    md["source"] = "".join(md["source"]) + "\nA sentence added in English."
    (root / "notebooks" / english.name).write_text(json.dumps(nb))
    status = _run(root, "status")
    assert status.returncode == 1 and md["id"] in status.stdout and "changed in English" in status.stdout
    assert _run(root, "extract", english.stem).returncode == 0
    entry = next(e for e in polib.pofile(str(root / "notebooks/zh/po" / f"{english.stem}.po"))
                 if e.msgctxt == md["id"])
    assert "fuzzy" in entry.flags and entry.previous_msgid and entry.msgid.endswith("added in English.")
    assert _run(root, "status").returncode == 1      # still stale until a translator clears the fuzzy flag


def test_a_changed_code_cell_is_caught(tmp_path):
    english = TRANSLATED[0]
    root = _copy_lesson(tmp_path, english)
    zh = root / "notebooks" / "zh" / english.name
    nb = json.loads(zh.read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code" and c["id"] != ed.LANG_CELL_ID)
    code["source"] = "".join(code["source"]) + "\nprint('only in Chinese')"
    zh.write_text(json.dumps(nb))
    status = _run(root, "status")
    assert status.returncode == 1 and "differs from the catalogue" in status.stdout


def test_lang_switch():
    before = i18n.current()
    try:
        i18n.lang("zh_CN")
        assert i18n.lang() == "zh" and i18n.tr("matches", "一致") == "一致"
        i18n.lang("en")
        assert i18n.lang() == "en" and i18n.tr("matches", "一致") == "matches"
        with pytest.raises(ValueError, match="zeroedu.lang"):
            i18n.lang("fr")
    finally:
        i18n.lang(before)


def _sanitizers() -> list[tuple[re.Pattern, str]]:
    """nbval's own replacements (tests/nbval_sanitize.cfg), so the comparison below masks what nbval masks."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "tests" / "nbval_sanitize.cfg", encoding="ascii")
    def unescape(text: str) -> str:   # the file is ASCII and writes "≈" as \u2248, as nbval reads it
        return re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)

    return [(re.compile(unescape(parser[s]["regex"])), parser[s]["replace"]) for s in parser.sections()]


def _text_outputs(cell: dict, sanitizers) -> str:
    """The text nbval compares for a code cell: streams and text/plain results, sanitised (images are not). Joined
    into one string, since one kernel may flush a cell's prints as one stream output and another as several."""
    text = "".join("".join(o.get("text", "")) if o["output_type"] == "stream" else
                   "".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", []))
    for pattern, replace in sanitizers:
        text = pattern.sub(replace, text)
    return text


@pytest.mark.parametrize("english", TRANSLATED, ids=lambda p: p.stem)
def test_chinese_outputs_are_the_english_ones(english):
    """Why `make test` runs nbval on the English notebooks only: a Chinese notebook runs the same code cells, and
    the language switch changes only pictures and widgets, which nbval does not compare. So where its saved text
    outputs equal the English ones (masked as nbval masks them), nbval over the Chinese notebook checks exactly
    what nbval over the English one checks, and running it would run the same code twice for nothing. A lesson
    whose printed text came to depend on the language would fail here; then give it an nbval run of its own."""
    sanitizers = _sanitizers()
    en = [c for c in _cells(english) if c["cell_type"] == "code"]
    zh = [c for c in _cells(ed.zh_path(english)) if c["cell_type"] == "code" and c["id"] != ed.LANG_CELL_ID]
    for e, z in zip(en, zh, strict=True):
        if "NBVAL_IGNORE_OUTPUT" in "".join(e["source"]) or "NBVAL_SKIP" in "".join(e["source"]):
            continue
        assert _text_outputs(z, sanitizers) == _text_outputs(e, sanitizers), \
            f"cell {e['id']}: the Chinese notebook's saved output differs from the English one " \
            f"(re-run `python -m zeroedu.i18n build --execute {english.stem}` after re-executing the English)"
