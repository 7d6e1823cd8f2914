"""The Chinese edition never goes stale: each translated lesson's catalogue matches its English cells, and its
notebook in notebooks/zh/ is exactly what the catalogue builds (so its code cells are the English code cells). The
same holds for the exercises: notebooks/zh/exercises/ is built from solutions/ and notebooks/zh/po/exNN_*.po, and
`zeroedu grade` grades a Chinese notebook exactly as it grades the English one."""

from __future__ import annotations

import configparser
import json
import os
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
SOLUTIONS = ed.translated_solutions()


def test_the_edition_has_lessons_and_exercises():
    assert TRANSLATED, "no lesson has a Chinese catalogue in notebooks/zh/po/"
    assert SOLUTIONS == ed.solution_notebooks(), \
        "every exercise has its instructions in Chinese: notebooks/zh/po/ lacks " + \
        ", ".join(p.stem for p in ed.solution_notebooks() if p not in SOLUTIONS)


@pytest.mark.parametrize("english", TRANSLATED + SOLUTIONS, ids=lambda p: p.stem)
def test_translation_is_current(english):
    status = ed.check(english)
    assert status.ok, status.describe() + " (python -m zeroedu.i18n status; docs/zh/style.md says how to update)"


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _pairs(english: Path) -> list[tuple[Path, Path]]:
    """(English, Chinese) files of one notebook: a lesson, or an exercise (the Chinese solution is never saved)."""
    if not ed.is_solution(english):
        return [(english, ed.zh_path(english))]
    return [(ROOT / "exercises" / english.name, ed.zh_exercise_path(english))]


@pytest.mark.parametrize("pair", [p for nb in TRANSLATED + SOLUTIONS for p in _pairs(nb)],
                         ids=lambda p: str(p[1].relative_to(ROOT)))
def test_code_cells_are_the_english_ones(pair):
    """Read straight from the two files: the Chinese notebook's code, minus its one language cell, is the English
    code, cell for cell, and every markdown cell of the Chinese notebook is a translation (not the English text).
    For an exercise the English side is exercises/NAME.ipynb as `zeroedu build-exercises` wrote it, so the Chinese
    learner gets the same stubs, the same visible tests and the same nbgrader metadata."""
    english, chinese = pair
    en, zh = _cells(english), _cells(chinese)
    lang = [c for c in zh if "zeroedu-lang" in c.get("metadata", {}).get("tags", [])]
    assert len(lang) == 1 and "zeroedu.lang(\"zh\")" in "".join(lang[0]["source"])
    zh = [c for c in zh if c is not lang[0]]
    assert [(c["cell_type"], "".join(c["source"])) for c in en if c["cell_type"] == "code"] == \
        [(c["cell_type"], "".join(c["source"])) for c in zh if c["cell_type"] == "code"]
    assert [c["metadata"].get("nbgrader") for c in en] == [c["metadata"].get("nbgrader") for c in zh]
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
            "r/'notebooks'/'zh'/'po'; ed.SOLUTIONS, ed.EXERCISES = r/'solutions', r/'exercises'; "
            "sys.exit(m.main(sys.argv[1:]))")
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


def _copy_exercise(tmp_path: Path, solution: Path) -> Path:
    root = tmp_path / "course"
    for folder in ("solutions", "notebooks/zh/po", "notebooks/zh/exercises"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    shutil.copy(solution, root / "solutions" / solution.name)
    shutil.copy(ed.po_path(solution), root / "notebooks" / "zh" / "po" / ed.po_path(solution).name)
    shutil.copy(ed.zh_exercise_path(solution), root / "notebooks" / "zh" / "exercises" / solution.name)
    return root


def test_a_changed_solution_or_a_hand_edited_chinese_exercise_is_caught(tmp_path):
    solution = SOLUTIONS[0]
    root = _copy_exercise(tmp_path, solution)
    assert _run(root, "status", solution.stem).returncode == 0
    exercise = root / "notebooks" / "zh" / "exercises" / solution.name   # a stub edited by hand, not via the solution
    nb = json.loads(exercise.read_text())
    stub = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("solution"))
    stub["source"] = "".join(stub["source"]) + "\n# edited here"
    exercise.write_text(json.dumps(nb))
    status = _run(root, "status", solution.stem)
    assert status.returncode == 1 and "differs from the catalogue" in status.stdout
    assert _run(root, "build", solution.stem).returncode == 0 and _run(root, "status", solution.stem).returncode == 0
    nb = json.loads((root / "solutions" / solution.name).read_text())   # the English instructions move on
    md = next(c for c in nb["cells"] if c["cell_type"] == "markdown" and c["id"] != "zeroedu-badges")
    md["source"] = "".join(md["source"]) + "\nOne more English sentence."
    (root / "solutions" / solution.name).write_text(json.dumps(nb))
    status = _run(root, "status", solution.stem)
    assert status.returncode == 1 and md["id"] in status.stdout and "changed in English" in status.stdout


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


# A number standing alone (not the 16 of "bf16" or the 8 of "int8"; "1.1x" is 1.1), and the verdict marks a check
# prints.
_NUMBER = re.compile(r"(?<![A-Za-z_\d.,])([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?)"
                     r"(?:x\b|(?![A-Za-z_\d]|\.\d))")
_VERDICT = re.compile(r"✓|✗|✅|❌|⚠|True|False")
_CJK = re.compile(r"[\u4e00-\u9fff]")


def _neutral(text: str) -> list[list[str]]:
    """What a printed text says whatever its language: per line that has any, its numbers and verdicts (True,
    False, ✓, ✗ ...), as a sorted list (a Chinese sentence may name them in another order). Lines without any are
    prose, which the translation rewrites."""
    out = []
    for line in text.splitlines():
        tokens = sorted(_NUMBER.findall(line) + _VERDICT.findall(line))
        if tokens:
            out.append(tokens)
    return out


def test_neutral_text_sees_a_changed_number_or_verdict():
    en = "stage 3 sends 3 x 1,024 bytes in bf16: True, at N = 65,536, nodes of 8.\nprose only\n✓ within 1.1x (2/2)"
    zh = "stage 3 以 bf16 发送 3 x 1,024 字节：True，N = 65,536，每节点 8 卡。\n✓ 在 1.1 倍以内 (2/2)"
    assert _neutral(en) == _neutral(zh)
    for wrong in (zh.replace("1,024", "1,025"), zh.replace("True", "False"), zh.replace("✓", "✗"),
                  zh.replace("(2/2)", "(1/2)"), zh.replace("stage 3 ", "stage 2 "), zh.replace("1.1 倍", "1 倍")):
        assert _neutral(en) != _neutral(wrong), wrong


@pytest.mark.parametrize("english", TRANSLATED, ids=lambda p: p.stem)
def test_chinese_outputs_are_the_english_ones(english):
    """Why `make test` runs nbval on the English notebooks only: a Chinese notebook runs the same code cells, and
    the language switch changes only words: pictures, widgets, and the prose a cell prints through `tr()`. So a
    cell's saved text output must equal the English one (masked as nbval masks it); or, where the Chinese output
    speaks more Chinese than the English one, say the same numbers and verdicts line by line (`_neutral`). Then
    nbval over the Chinese notebook would check the same bytes, counts and verdicts as nbval over the English one,
    and running it would run the same code twice for nothing. A cell whose numbers came to depend on the language
    fails here."""
    sanitizers = _sanitizers()
    en = [c for c in _cells(english) if c["cell_type"] == "code"]
    zh = [c for c in _cells(ed.zh_path(english)) if c["cell_type"] == "code" and c["id"] != ed.LANG_CELL_ID]
    for e, z in zip(en, zh, strict=True):
        if "NBVAL_IGNORE_OUTPUT" in "".join(e["source"]) or "NBVAL_SKIP" in "".join(e["source"]):
            continue
        en_text, zh_text = _text_outputs(e, sanitizers), _text_outputs(z, sanitizers)
        if en_text == zh_text:
            continue
        rerun = f"(re-run `python -m zeroedu.i18n build --execute {english.stem}` after re-executing the English)"
        assert len(_CJK.findall(zh_text)) > len(_CJK.findall(en_text)), \
            f"cell {e['id']}: the Chinese notebook's saved output differs from the English one {rerun}"
        assert _neutral(zh_text) == _neutral(en_text), \
            f"cell {e['id']}: the Chinese output says other numbers or verdicts than the English one {rerun}"


# -- the Chinese exercises, graded by the real grader ------------------------------------------------------------

GRADED_IN_CHINESE = ["ex01_memory_formulas", "ex09_choose_strategy", "ex10_spot_the_errors"]


def _points(name: str) -> dict[str, float]:
    """grade_id -> points of every graded cell of the ENGLISH solution, from its nbgrader metadata."""
    meta = [c["metadata"].get("nbgrader", {}) for c in _cells(ROOT / "solutions" / f"{name}.ipynb")]
    return {m["grade_id"]: float(m["points"]) for m in meta if m.get("grade")}


@pytest.mark.timeout(600)
def test_chinese_exercises_grade_as_the_english_ones(tmp_path):
    """`zeroedu grade` on a class of two: one learner hands in the Chinese solutions, the other the Chinese stubs,
    for an exercise that trains on ranks (ex01), a closed-form one (ex09) and one whose answers the grader reads
    from the notebook's text (ex10). Each is matched to the English solution and graded against its tests (the
    expected points come from its nbgrader metadata, not from the grader): full marks and zero. The Chinese
    solution is what `python -m zeroedu.i18n build --solution-to DIR` writes."""
    for name in GRADED_IN_CHINESE:
        ed.write(tmp_path / "class" / "solution" / f"{name}.ipynb", ed.build(ROOT / "solutions" / f"{name}.ipynb"))
        (tmp_path / "class" / "stub").mkdir(parents=True, exist_ok=True)
        shutil.copy(ed.zh_exercise_path(ROOT / "solutions" / f"{name}.ipynb"), tmp_path / "class" / "stub")
    book = tmp_path / "grades.json"
    sandbox = [] if shutil.which("bwrap") else ["--trusted"]   # .ci/run has bubblewrap; a laptop may not
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(tmp_path / "class"), "--json", str(book),
                           "--quiet", *sandbox], capture_output=True, text=True, cwd=ROOT, timeout=580,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert book.exists(), proc.stdout + proc.stderr
    graded = {(e["learner"], e["exercise"]): e for who in json.loads(book.read_text())["learners"]
              for e in who["exercises"]}
    assert set(graded) == {(who, name) for who in ("solution", "stub") for name in GRADED_IN_CHINESE}
    for name in GRADED_IN_CHINESE:
        want = _points(name)
        full, stub = graded["solution", name], graded["stub", name]
        assert full["status"] == stub["status"] == "graded", (full["notes"], stub["notes"])
        assert {t["grade_id"]: t["points"] for t in full["tests"]} == want, \
            [(t["grade_id"], t["message"]) for t in full["tests"] if not t["passed"]]
        assert full["points"] == full["max_points"] == sum(want.values())
        assert {t["grade_id"] for t in stub["tests"]} == set(want)
        assert stub["points"] == 0 and stub["max_points"] == sum(want.values())
        # and the grader spoke the notebooks' language: every check name and every failure in 中文
        assert full["language"] == stub["language"] == "zh"
        for t in full["tests"] + stub["tests"]:
            assert _CJK.search(t["name"]), t
            assert t["passed"] or _CJK.search(t["message"]), t
