"""The instructor's kit around `zeroedu grade`: the LMS files (--wide, --roster, --canvas, --moodle), per-learner
HTML feedback, the class's misconception report. Every test grades real notebooks with the real grader (the
learners' answers are the solutions', or a planted mistake from tests/grading_fixtures/), in a subprocess, as an
instructor runs it; the expected numbers come from the solutions' nbgrader metadata, not from the code under test.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_grading import WRONG, _points, make_submission
from test_translations import _CJK

from zeroedu.grading import hints, misconceptions

ROOT = Path(__file__).resolve().parents[1]


def _grade(*args: str, timeout: int = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "zeroedu", "grade", *args, "--trusted", "--quiet", "--jobs", "2"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


EX01, EX09 = "ex01_memory_formulas", "ex09_choose_strategy"
EVE = "eve<b onmouseover=alert(1)>&"     # a folder name that is HTML


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """alice: ex01 without 1/N; bob: ex01 right, ex09 without the reserve; '=mallory': ex01 right but not in the
    roster (and a name a spreadsheet would run as a formula); carol: in the roster, handed in nothing."""
    tmp = tmp_path_factory.mktemp("kit")
    subs = tmp / "submissions"
    make_submission(EX01, "ex01_missing_1_over_n.cells", subs / "alice")
    make_submission(EX01, None, subs / "bob")
    make_submission(EX09, "ex09_no_reserve.cells", subs / "bob")
    make_submission(EX01, None, subs / "=mallory")
    make_submission(EX01, "ex01_missing_1_over_n.cells", subs / EVE)
    roster = tmp / "roster.csv"
    roster.write_text("\ufefffolder,id,name,email,section\nalice,S001,Alice Li,alice@uni.edu,A\n"
                      "bob,S002,\"Bob, Jr.\",bob@uni.edu,A\ncarol,S003,Carol Wu,carol@uni.edu,B\n", encoding="utf-8")
    out = tmp / "out"
    out.mkdir()
    proc = _grade(str(subs), "--roster", str(roster), "--json", str(out / "long.json"), "--wide",
                  str(out / "wide.csv"), "--canvas", str(out / "canvas.csv"), "--moodle", str(out / "moodle.csv"),
                  "--feedback", str(out / "feedback"), "--report", str(out / "report.md"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def _expected() -> dict[str, dict[str, float]]:
    """Each learner's points per exercise from the solutions' metadata and the fixtures' failing tests."""
    p01, p09 = _points(EX01), _points(EX09)
    alice01 = sum(p01.values()) - sum(p01[g] for g in WRONG["ex01_missing_1_over_n.cells"][1])
    bob09 = sum(p09.values()) - sum(p09[g] for g in WRONG["ex09_no_reserve.cells"][1])
    full01 = sum(p01.values())
    return {"alice": {EX01: alice01, EX09: 0}, "bob": {EX01: full01, EX09: bob09},
            "=mallory": {EX01: full01, EX09: 0}, "carol": {EX01: 0, EX09: 0}, EVE: {EX01: alice01, EX09: 0}}


@pytest.mark.timeout(600)
def test_wide_table_has_every_learner_once_with_points_and_total(graded):
    out, _ = graded
    rows = _rows(out / "wide.csv")
    assert rows[0] == ["learner", "id", "name", "status", EX01, EX09, "total"]
    full = [sum(_points(EX01).values()), sum(_points(EX09).values())]
    assert rows[1][4:] == [f"{full[0]:g}", f"{full[1]:g}", f"{sum(full):g}"]
    by = {r[0]: r for r in rows[2:]}
    assert set(by) == {"alice", "bob", "'=mallory", "carol", EVE}, by   # the formula-looking name is defused
    expected = _expected()
    for folder, row in by.items():
        want = expected[folder.lstrip("'")]
        assert [float(x) for x in row[4:6]] == [want[EX01], want[EX09]], row
        assert float(row[6]) == want[EX01] + want[EX09]
    assert by["alice"][1:4] == ["S001", "Alice Li", "graded"]
    assert by["'=mallory"][1] == "" and by["'=mallory"][3] == "not in roster"
    assert by["carol"][3] == "no submission"
    # The long gradebook of the same run (another writer) agrees on every learner's total.
    long = {e["learner"]: e["points"] for e in json.loads((out / "long.json").read_text())["learners"]}
    assert {k: float(by["'=mallory" if k == "=mallory" else k][6]) for k in long} == long


@pytest.mark.timeout(600)
def test_canvas_and_moodle_files_hold_roster_learners_and_name_the_others(graded):
    out, proc = graded
    canvas = _rows(out / "canvas.csv")
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", EX01, EX09]
    expected = _expected()
    by_id = {r[2]: r for r in canvas[1:]}
    assert set(by_id) == {"S001", "S002", "S003"}
    assert by_id["S002"][0] == "Bob, Jr." and by_id["S003"][4] == "B"
    assert [float(x) for x in by_id["S002"][5:]] == [expected["bob"][EX01], expected["bob"][EX09]]
    moodle = _rows(out / "moodle.csv")
    assert moodle[0] == ["idnumber", "email", EX01, EX09]
    assert {r[0]: float(r[2]) for r in moodle[1:]} == {"S001": expected["alice"][EX01],
                                                        "S002": expected["bob"][EX01], "S003": 0.0}
    for row in moodle[1:]:   # Moodle aborts the whole import on a grade that is not a number
        assert all(float(x) >= 0 for x in row[2:])
    # Never dropped silently: the learner the LMS files cannot hold, and the one who handed in nothing.
    assert "not in the roster (no LMS id; left out of the Canvas/Moodle files): =mallory" in proc.stderr
    assert "no submission (0 on every exercise): carol (S003)" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("roster, words", [
    ("name,id\nalice,S1\n", "has no column folder"),
    ("folder,id\nalice,S1\nbob,S1\n", "gives the id 'S1' to more than one folder"),
    ("folder,id\nalice,S1\nalice,S2\n", "folder 'alice' is listed twice"),
    ("folder,id\nalice,\n", "line 2: folder and id must both be filled in"),
])
def test_a_broken_roster_is_refused_before_anything_is_graded(tmp_path, roster, words):
    make_submission(EX01, None, tmp_path / "subs" / "alice")
    (tmp_path / "roster.csv").write_text(roster)
    proc = _grade(str(tmp_path / "subs"), "--roster", str(tmp_path / "roster.csv"), "--wide",
                  str(tmp_path / "w.csv"), timeout=100)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert not (tmp_path / "w.csv").exists()


@pytest.mark.timeout(120)
def test_canvas_without_a_roster_says_why(tmp_path):
    make_submission(EX01, None, tmp_path / "subs" / "alice")
    proc = _grade(str(tmp_path / "subs"), "--canvas", str(tmp_path / "c.csv"), timeout=100)
    assert proc.returncode == 2 and "--canvas and --moodle need --roster" in proc.stderr


# -- feedback and the misconception report ------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_feedback_pages_are_escaped_self_contained_and_hold_every_check(graded):
    out, _ = graded
    pages = {p.name: p.read_text(encoding="utf-8") for p in (out / "feedback").iterdir()}
    eve_page = "eve_b_onmouseover_alert_1___.html"    # no character of the folder name that HTML or a path reads
    assert set(pages) == {"alice.html", "bob.html", "_mallory.html", "carol.html", eve_page}
    assert "No submission was found for you" in pages["carol.html"] and "S003" in pages["carol.html"]
    long = {e["learner"]: e for e in json.loads((out / "long.json").read_text())["learners"]}
    for learner, entry in long.items():
        name = {EVE: eve_page, "=mallory": "_mallory.html"}.get(learner, f"{learner}.html")
        text = pages[name]
        for ex in entry["exercises"]:
            for t in ex["tests"]:   # every check, with its verdict mark and its points
                row = next(r for r in text.split("<tr>") if f"<td>{html.escape(t['name'])}" in r)
                assert ("✓" if t["passed"] else "✗") in row and f"{t['points']:g}/{t['max_points']:g}" in row
                if t["message"]:
                    assert html.escape(t["message"]) in row
        assert f"{entry['points']:g}/{entry['max_points']:g}" in text
    eve = pages[eve_page]
    assert "<b onmouseover" not in eve and "eve&lt;b onmouseover=alert(1)&gt;&amp;" in eve
    for text in pages.values():    # nothing fetched: no script, no external resource
        assert "<script" not in text and "src=" not in text and "href=" not in text
    # A failed check shows its first hint, not the last (closest to the answer).
    alice = pages["alice.html"]
    first, last = hints.TOPICS["ex01-model-state-bytes"][1][0], hints.TOPICS["ex01-model-state-bytes"][1][-1]
    assert html.escape(first[0]) in alice and html.escape(first[1]) in alice
    assert html.escape(last[0]) not in alice
    assert "S001" in alice    # the roster's id


def test_small_report_counts_learners_not_checks(graded):
    out, _ = graded
    en = (out / "report.md").read_text(encoding="utf-8")
    zh = (out / "report.zh.md").read_text(encoding="utf-8")
    opt = next(m for m in misconceptions.CATALOGUE if m.key == "opt-not-divided")
    # alice and eve each fail three ex01 checks for this one mistake; 5 learners handed ex01 in.
    row = next(line for line in en.splitlines() if opt.en in line and line.startswith("| 1 |"))
    assert "| 2 of 4 |" in row, row       # out of the 4 whose ex01 was graded (carol handed nothing in)
    assert f"- {opt.en}: alice, eve" in en
    assert "| 4 人中 2 人 |" in zh and opt.zh in zh


PLANTED = {   # fixture -> the misconceptions its first comment says it plants
    "ex01_missing_1_over_n.cells": {"opt-not-divided"},
    "ex02_broken_ranks.cells": {"ring-index", "deadlock"},
    "ex02_rs_no_average.cells": {"sum-not-mean"},
    "ex02_rs_off_by_one.cells": {"ring-off-by-one"},
    "ex03_late_reduce.cells": {"bucket-boundary", "no-overlap"},
    "ex04_no_all_gather.cells": {"no-all-gather"},
    "ex05_sum_overwrite.cells": {"sum-not-mean", "accumulate-overwrites"},
    "ex06_never_releases.cells": {"never-released"},
    "ex07_fp32_to_device.cells": {"fp32-to-device"},
    "ex08_one_scale.cells": {"one-scale"},
    "ex09_no_reserve.cells": {"no-reserve"},
}


def _failures_of(graded, learner: str) -> list:
    """What a failed report assertion shows of a learner: each notebook's status and notes, and (check, message)
    of every check failed."""
    return [(e["exercise"], e["status"], e["notes"], [(t["grade_id"], t["message"]) for t in e["tests"]
                                                      if not t["passed"]])
            for (who, _), e in graded.results.items() if who == learner and e["status"] != "not submitted"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("edition", ["en", "zh"])
def test_report_on_the_wrong_answer_fixtures_names_each_planted_misconception(edition, request):
    """The misconception report of the class run that test_grading's wrong-answer tests read (conftest), and of
    the same mistakes made in the Chinese exercise notebooks: the hints speak 中文 there, and the report still
    names every mistake (its catalogue reads both languages)."""
    graded = request.getfixturevalue({"en": "wrong_answer_class", "zh": "wrong_answer_class_zh"}[edition])
    assert set(PLANTED) <= set(WRONG) and {f for f in WRONG if f.endswith(".cells")} == set(PLANTED)
    en, zh = graded.report_en, graded.report_zh
    who = {}
    for line in en.split("## Who, per misconception")[1].strip().splitlines():
        label, names = line[2:].rsplit(": ", 1)
        who[label] = set(names.split(", "))
    for fixture, keys in PLANTED.items():
        learner = fixture.removesuffix(".cells")
        for key in sorted(keys):
            m = next(m for m in misconceptions.CATALOGUE if m.key == key)
            assert learner in who.get(m.en, set()), (fixture, key, _failures_of(graded, learner))
            assert m.zh in zh and m.revisit in en
    if edition == "zh":   # every hint in 中文, the ones the ranks write in the kernel included
        for e in (e for e in graded.results.values() if e["status"] == "graded"):
            assert e["language"] == "zh", e["exercise"]
            assert all(t["passed"] or _CJK.search(t["message"]) for t in e["tests"]), e["tests"]
    # The one mistake two exercises share is counted over both: 2 learners of the 4 who handed ex02 or ex05 in.
    table = [line for line in en.splitlines() if re.match(r"\| \d+ \| \d+ of \d+ \|", line)]
    sum_row = next(line for line in table if "summed the ranks' gradients without dividing by N" in line)
    assert "| 2 of 4 |" in sum_row, en
    counts = [int(re.match(r"\| \d+ \| (\d+) of", line).group(1)) for line in table]
    assert counts == sorted(counts, reverse=True) and counts[0] == 2, en      # most learners first
