"""The grader end to end when a learner's notebook hangs, crashes, or a rank leaves the collective: the gradebook
keeps every learner's line and says why. Split from tests/test_grading.py (whose helpers these use) so that
`make test`'s two streams take about equal time: this file runs in the foreground stream, test_grading.py beside
it after nbval (the Makefile's PYTEST_BESIDE)."""

import csv
import io
import json
import re
import time
from contextlib import redirect_stdout

import pytest
from test_grading import SOLUTIONS, _points, _sandboxed_or_trusted, make_submission

from zeroedu.grading import grader


@pytest.mark.timeout(400)
def test_gradebook_of_three_learners_one_hanging_one_crashing(tmp_path):
    folder = tmp_path / "submissions"
    for exercise in ("ex01_memory_formulas", "ex09_choose_strategy"):
        make_submission(exercise, None, folder / "alice")
    make_submission("ex01_memory_formulas", "gradebook/bob_hangs.cells", folder / "bob")
    make_submission("ex01_memory_formulas", "gradebook/carol_crashes.cells", folder / "carol")
    j, c = tmp_path / "grades.json", tmp_path / "grades.csv"
    out = io.StringIO()
    t0 = time.monotonic()
    with redirect_stdout(out):
        rc = grader.main([str(folder), "--solutions", str(SOLUTIONS), "--json", str(j), "--csv", str(c),
                          "--timeout", "4", "--quiet"])
    elapsed = time.monotonic() - t0
    assert rc == 0
    p01, p09 = _points("ex01_memory_formulas"), _points("ex09_choose_strategy")
    max01, max09 = sum(p01.values()), sum(p09.values())
    book = {e["learner"]: e for e in json.loads(j.read_text())["learners"]}
    assert list(book) == ["alice", "bob", "carol"]
    assert (book["alice"]["points"], book["alice"]["max_points"]) == (max01 + max09, max01 + max09)
    bob = {e["exercise"]: e for e in book["bob"]["exercises"]}
    # His loop never let bytes_per_element exist: every test needs it (the error test calls a valid case first).
    assert [t["grade_id"] for t in bob["ex01_memory_formulas"]["tests"] if t["passed"]] == []
    assert bob["ex01_memory_formulas"]["points"] == 0
    assert bob["ex09_choose_strategy"]["status"] == "not submitted"
    assert bob["ex01_memory_formulas"]["notes"][0] == (
        "the answer cell 'ex01-bytes-per-element' failed: ran past 4 s and ignored the interrupt: the kernel and "
        "every process it started were killed, and a fresh kernel ran the cells after it")
    assert bob["ex01_memory_formulas"]["first_failure"] == (
        "bytes per element: fp32 4, bf16 2, fp16 2, others rejected: name 'bytes_per_element' is not defined (" +
        bob["ex01_memory_formulas"]["notes"][0] + ")")
    carol = {e["exercise"]: e for e in book["carol"]["exercises"]}["ex01_memory_formulas"]
    # bytes_per_element ran before her kernel died; everything that needs model_state_bytes fails.
    assert carol["points"] == p01["ex01-test-precision"]
    assert carol["notes"][0].startswith("the answer cell 'ex01-model-state-bytes' failed: the kernel died while it ran")
    assert carol["notes"][0].endswith("a fresh kernel ran the cells after it")
    assert carol["first_failure"].endswith(f"name 'model_state_bytes' is not defined ({carol['notes'][0]})")
    rows = list(csv.DictReader(c.open()))
    assert [(r["learner"], r["exercise"], r["points"], r["max_points"], r["status"]) for r in rows] == [
        ("alice", "ex01_memory_formulas", f"{max01:g}", f"{max01:g}", "graded"),
        ("alice", "ex09_choose_strategy", f"{max09:g}", f"{max09:g}", "graded"),
        ("bob", "ex01_memory_formulas", "0", f"{max01:g}", "graded"),
        ("bob", "ex09_choose_strategy", "0", f"{max09:g}", "not submitted"),
        ("carol", "ex01_memory_formulas", f"{p01['ex01-test-precision']:g}", f"{max01:g}", "graded"),
        ("carol", "ex09_choose_strategy", "0", f"{max09:g}", "not submitted"),
    ]
    assert rows[2]["first_failure"] == bob["ex01_memory_formulas"]["first_failure"]
    table = out.getvalue()
    tests01 = len(p01)
    assert re.search(rf"^alice\s+ex01_memory_formulas\s+{max01:g}/{max01:g}\s+{tests01}/{tests01}\s+-$", table,
                     re.M), table
    assert f"bob: 0/{max01 + max09:g}" in table and f"carol: 1/{max01 + max09:g}" in table
    assert elapsed < 300




@pytest.mark.timeout(600)
def test_rank_failures_keep_the_learners_line_and_name_the_rank_that_left_the_collective(tmp_path):
    folder = tmp_path / "submissions"
    for fixture in ("ex04_rank_raises.cells", "ex04_rank_skips.cells", "ex04_collective_mismatch.cells"):
        make_submission("ex04_stage1_sharding", f"hostile/{fixture}", folder / fixture.removesuffix(".cells"))
    results = grader.grade([folder], SOLUTIONS, grader.Limits(cell_timeout=24), progress=False,
                           options=_sandboxed_or_trusted([folder]), jobs=2)
    by = {r.learner: {t.grade_id: t for t in r.tests} for r in results}
    raises, skips, mismatch = by["ex04_rank_raises"], by["ex04_rank_skips"], by["ex04_collective_mismatch"]
    message = raises["ex04-test-trains"].message
    assert "on rank 1 of 2, MyStage1 raised ValueError: publish on rank 1 gave up on bucket 0" in message, message
    assert "in publish, line" in message and 'raise ValueError(f"publish on rank' in message, message
    hang = skips["ex04-test-trains"].message
    assert "MyStage1 hung" in hang and "Rank 1 is not in the collective the other ranks wait in" in hang, hang
    assert "in publish, line" in hang and "time.sleep(0.1)" in hang, hang
    assert "In a ring" not in hang   # the ring exercise's hint belongs to the ring exercise
    # the launcher's whole message, not its first line: what each rank waits in, and the advice at its end
    other = mismatch["ex04-test-trains"].message
    assert "MyStage1: ranks called different collectives (collective mismatch: " in other, other
    assert "torch.distributed.all_reduce" in other and "This would deadlock" in other, other
    assert "Status of every rank: rank 0: " in other and "Every rank of a group must call the same" in other, other


