"""Progressive hints: every check of every solution has hints in English and 中文, and a learner who grades their
own notebook sees the first hint, then the next ones on later failures (counted next to their self-grades)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from test_grading import make_submission

from zeroedu.grading import hints

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")


def _test_ids() -> dict[str, str]:
    """grade_id -> exercise, for every test cell of every solution notebook (read from its nbgrader metadata)."""
    out = {}
    for path in sorted((ROOT / "solutions").glob("ex*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade"):
                out[meta["grade_id"]] = path.stem
    return out


def test_every_check_has_three_hints_in_both_languages():
    ids = _test_ids()
    covered = [g for tests, _ in hints.TOPICS.values() for g in tests]
    assert sorted(covered) == sorted(set(covered)), "a check in two topics"
    assert set(covered) == set(ids), (set(ids) - set(covered), set(covered) - set(ids))
    for topic, (tests, texts) in hints.TOPICS.items():
        assert len(texts) == 3, topic
        assert {ids[g] for g in tests} == {ids[tests[0]]}, topic     # one exercise per topic
        for en, zh in texts:
            assert en and not CJK.search(en.replace("对", "").replace("错", "").replace("元素", "")
                                         .replace("字节", "")), (topic, en)
            assert CJK.search(zh), (topic, zh)
        assert len({en for en, _ in texts}) == len({zh for _, zh in texts}) == 3, topic   # three different hints


def _self_grade(notebook: Path, lang: str = "en") -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZEROEDU_LANG": lang}
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(notebook), "--quiet"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.timeout(600)
def test_self_grading_gives_the_next_hint_on_each_failure(tmp_path):
    notebook = make_submission("ex01_memory_formulas", "ex01_missing_1_over_n.cells", tmp_path / "exercises")
    texts = hints.TOPICS["ex01-model-state-bytes"][1]
    failing = {"ex01-test-table1", "ex01-test-live", "ex01-hidden-formulas"}   # tests/test_grading.py's WRONG
    first = _self_grade(notebook)
    assert f"hint 1/3 (ex01-test-table1): {texts[0][0]}" in first
    assert texts[1][0] not in first and texts[2][0] not in first
    second = _self_grade(notebook, "zh")
    assert f"提示 2/3 (ex01-test-table1): {texts[1][1]}" in second
    third = _self_grade(notebook)
    assert f"hint 3/3 (ex01-test-live): {texts[2][0]}" in third
    counts = json.loads((tmp_path / "exercises" / ".zeroedu-grades" / "ex01_memory_formulas.hints.json").read_text())
    assert counts == {g: 3 for g in failing}
    # zeroedu progress still reads its own record beside it.
    assert json.loads((tmp_path / "exercises" / ".zeroedu-grades" / "ex01_memory_formulas.json").read_text())[
        "passed_tests"] == 3


def test_instructors_get_every_hint():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "zeroedu", "grade", "--hints"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60).stdout
    for topic, (tests, texts) in hints.TOPICS.items():
        assert topic in out and all(g in out for g in tests)
        for en, zh in texts:
            assert en in out and zh in out
