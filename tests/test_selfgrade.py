"""Self-grading (`zeroedu grade NOTEBOOK`, `zeroedu.grade()`) and `zeroedu progress`, on real notebooks and real
gradings. Expected tests and points are read from solutions/ (nbgrader metadata), not from the grader.

Without bubblewrap is simulated by running the grader with a PATH that has no bwrap on it (only the venv's bin):
the grader finds bubblewrap with shutil.which, as it would on a Mac."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zeroedu.course import progress, selfgrade
from zeroedu.grading import results as graded

ROOT = Path(__file__).resolve().parents[1]
EX = "ex01_memory_formulas"


def solution_tests(name: str) -> list[tuple[str, float]]:
    """(grade_id, points) of every graded cell of solutions/NAME.ipynb, from its nbgrader metadata."""
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text(encoding="utf-8"))
    meta = [c["metadata"].get("nbgrader", {}) for c in nb["cells"]]
    return [(m["grade_id"], float(m["points"])) for m in meta if m.get("grade")]


def no_bwrap_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROEDU_")}
    env["PATH"] = str(Path(sys.executable).parent)         # no /usr/bin: no bwrap, as on macOS
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_own_notebook_is_one_file_of_yours(tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "alice").mkdir()
    mine = tmp_path / "exercises" / f"{EX}.ipynb"
    shutil.copy(ROOT / "exercises" / f"{EX}.ipynb", mine)
    handed_in = tmp_path / "alice" / f"{EX}.ipynb"                             # an instructor's copy of a submission
    shutil.copy(mine, handed_in)
    assert selfgrade.own_notebook([mine], []) == mine
    assert selfgrade.own_notebook([handed_in], []) is None
    assert selfgrade.own_notebook([handed_in], [], anywhere=True) == handed_in  # --mine: the learner says so
    assert selfgrade.own_notebook([tmp_path / "exercises"], []) is None         # a folder: bulk grading
    assert selfgrade.own_notebook([mine, mine], []) is None                     # several
    assert selfgrade.own_notebook([mine], ["--json", "g.json"]) is None        # a gradebook is for others' work
    if os.getuid() == 0:                                                        # a file someone else owns
        os.chown(mine, 65534, 65534)
        assert selfgrade.own_notebook([mine], []) is None


def test_details_prints_every_test_and_its_whole_message():
    long_hint = "expected 120.0 GB per rank at N=64 (16Ψ), got 30.0: did you divide the fp16 parameters by N?\n" \
                "second line of the hint " + "x" * 200
    r = graded.ExerciseResult("me", EX, "exercises/ex01.ipynb", points=1, max_points=4, seconds=3.2, tests=[
        graded.TestResult("a", "bytes per element", 1, 1, True),
        graded.TestResult("b", "stage 0", 0, 3, False, long_hint, hidden=True)])
    text = selfgrade.details(r)
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["PASS", "1/1"] and lines[2].split()[:2] == ["FAIL", "0/3"]
    assert "(hidden test)" in lines[2]
    assert long_hint.splitlines()[0] in text and long_hint.splitlines()[1] in text   # not cut
    assert lines[-1].startswith("score: 1/4 (1 of 2 tests passed")


def test_someone_elses_notebook_needs_the_sandbox_and_says_so(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to hand the file to another user")
    (tmp_path / "exercises").mkdir()
    theirs = tmp_path / "exercises" / f"{EX}.ipynb"
    shutil.copy(ROOT / "exercises" / f"{EX}.ipynb", theirs)
    os.chown(theirs, 65534, 65534)
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(theirs)], capture_output=True, text=True,
                          timeout=120, env=no_bwrap_env(), cwd=ROOT)
    assert proc.returncode == 3, proc
    assert "bubblewrap (bwrap) is not installed" in proc.stderr and "not yours" in proc.stderr, proc.stderr
    assert "your own notebook runs without it" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_self_grading_without_bubblewrap_prints_each_hint_and_progress_sees_it(tmp_path):
    """The done-when: one's own exercise, graded on a machine without bubblewrap, as a notebook cell would
    (zeroedu.grade -> python -m zeroedu grade): one line per test with its hint, then the score. Then the
    solution in its place passes, and `zeroedu progress` reads both gradings from the learner's folder."""
    course = tmp_path / "course"
    (course / "exercises").mkdir(parents=True)
    (course / "notebooks").mkdir()
    shutil.copytree(ROOT / "solutions", course / "solutions")
    mine = course / "exercises" / f"{EX}.ipynb"
    shutil.copy(ROOT / "exercises" / f"{EX}.ipynb", mine)
    tests = solution_tests(EX)
    full = sum(p for _, p in tests)
    cell = f"import zeroedu; raise SystemExit(zeroedu.grade({str(mine)!r}))"
    proc = subprocess.run([sys.executable, "-c", cell], capture_output=True, text=True, timeout=800,
                          env=no_bwrap_env(), cwd=course)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "your own notebook" in out and "without the sandbox" in out
    verdicts = [line for line in out.splitlines() if line.startswith(("  PASS", "  FAIL"))]
    assert len(verdicts) == len(tests), out
    assert all(line.startswith("  FAIL") for line in verdicts), out            # the template is not solved yet
    assert out.count("not implemented yet") >= len(tests), out                   # each test's hint, in full
    assert f"score: 0/{full:g} (0 of {len(tests)} tests passed" in out, out
    assert "not yet 未通过" in _progress(course, EX)

    shutil.copy(ROOT / "solutions" / f"{EX}.ipynb", mine)                      # the answers, as if written
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(mine)], capture_output=True, text=True,
                          timeout=800, env=no_bwrap_env(), cwd=course)
    assert proc.returncode == 0 and f"score: {full:g}/{full:g} ({len(tests)} of {len(tests)}" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "passes 通过" in _progress(course, EX)
    with mine.open("a") as f:
        f.write("\n")                                                            # edited after grading
    assert "changed since graded" in _progress(course, EX)


def _progress(course: Path, name: str) -> str:
    rows = {r[1]: r for r in progress.rows(course)}
    return rows[name][2]


def test_progress_reads_the_learners_files(tmp_path):
    """Lessons: a notebook saved after running differs from the shipped copy; one as shipped is not run. Read
    against a git repository made here (the shipped copy = its HEAD)."""
    course = tmp_path / "course"
    (course / "notebooks").mkdir(parents=True)
    (course / "exercises").mkdir()
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "1+1"},
                    {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "2+2"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    for name in ("00_a", "01_b", "02_c"):
        (course / "notebooks" / f"{name}.ipynb").write_text(json.dumps(nb))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=course, check=True)
    subprocess.run([*git, "add", "."], cwd=course, check=True)
    subprocess.run([*git, "commit", "-qm", "shipped"], cwd=course, check=True)
    ran = json.loads(json.dumps(nb))
    for i, c in enumerate(ran["cells"]):
        c["execution_count"] = i + 1
    (course / "notebooks" / "01_b.ipynb").write_text(json.dumps(ran))
    ran["cells"][1]["execution_count"] = None
    (course / "notebooks" / "02_c.ipynb").write_text(json.dumps(ran))
    status = {r[1]: r[2] for r in progress.rows(course)}
    assert status == {"00_a": "not run 未运行", "01_b": "run 已运行", "02_c": "started 进行中"}
    proc = subprocess.run([sys.executable, "-m", "zeroedu", "progress", str(course)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "1/3 lessons run 课已运行" in proc.stdout, proc
    assert "kind 类型" in proc.stdout and "status 状态" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "zeroedu", "progress", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "has no notebooks/ folder" in bad.stderr
