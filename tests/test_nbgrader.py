"""nbgrader itself on the course's exercises: the workflow docs/nbgrader.md describes, command by command.

A temporary nbgrader course is made from solutions/ex09 (closed-form, no ranks: the quickest exercise).
`generate_assignment` writes the release (the stub a learner gets); three submissions are autograded by
nbgrader in its own kernel: the solution, the release unmodified, and a release whose answer cell rebinds
`check` to a no-op. Scores are read from `nbgrader export`'s CSV; full marks are the sum of the points in the
solution notebook's graded cells, read here from the notebook.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbgrader")

ROOT = Path(__file__).resolve().parents[1]
EXERCISE = "ex09"
SOLUTION = ROOT / "solutions" / "ex09_choose_strategy.ipynb"

pytestmark = pytest.mark.slow

# A learner's answer cell that gives itself full marks under in-kernel autograding: the graded cells call
# `check` by its name in the learner's kernel, so rebinding the name turns every test into a no-op.
REBIND = '''\
def check(name, points=1, test=None):
    return (lambda fn: None) if test is None else None
'''


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # nbgrader runs `alembic` (its database migrations) by name, and the kernel must import this zeroedu.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def full_marks(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    return sum(c.metadata["nbgrader"]["points"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    course = tmp_path_factory.mktemp("nbgrader-course")
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(course)!r}\n"
        "c.CourseDirectory.course_id = 'zeroedu'\n"
        "c.Execute.timeout = 300  # seconds per cell; a loaded machine needs more than the default 30\n",
        encoding="utf-8")
    source = course / "source" / EXERCISE
    source.mkdir(parents=True)
    shutil.copy(SOLUTION, source)

    nbgrader(course, "generate_assignment", EXERCISE, "--force")
    release = course / "release" / EXERCISE / SOLUTION.name
    assert release.is_file()

    def submit(student: str, nb_path: Path, rebind: bool = False) -> None:
        folder = course / "submitted" / student / EXERCISE
        folder.mkdir(parents=True)
        nb = nbformat.read(nb_path, as_version=4)
        if rebind:
            answer = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution"))
            answer.source = REBIND + answer.source
        nbformat.write(nb, folder / SOLUTION.name)

    submit("solution", SOLUTION)
    submit("stub", release)
    submit("rebinds-check", release, rebind=True)
    nbgrader(course, "autograde", EXERCISE, "--create", "--force")
    nbgrader(course, "generate_feedback", EXERCISE, "--force")
    nbgrader(course, "export", "--to", str(course / "grades.csv"))
    return course


def scores(course: Path) -> dict[str, tuple[float, float]]:
    with open(course / "grades.csv", newline="", encoding="utf-8") as f:
        return {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}


def test_release_is_a_stub_without_solution_or_hidden_tests(course):
    release = (course / "release" / EXERCISE / SOLUTION.name).read_text(encoding="utf-8")
    assert "NotImplementedError" in release
    assert "BEGIN SOLUTION" not in release and "BEGIN HIDDEN TESTS" not in release
    # a line of the solution's answer and of a hidden test, each gone from the release
    assert "def fits(psi, n, stage, m, b, k, reserve)" not in release
    assert "def fits(psi, n, stage, m, b, k, reserve)" in SOLUTION.read_text(encoding="utf-8")


def test_solution_scores_full_marks_and_stub_scores_less(course):
    got = scores(course)
    total = full_marks(SOLUTION)
    assert total > 0
    assert got["solution"] == (total, total), f"the solution scored {got['solution']}, expected {total}/{total}"
    stub, stub_max = got["stub"]
    assert stub_max == total and stub < total, f"the unmodified release scored {stub}/{stub_max}"


def test_feedback_html_per_submission(course):
    for student in ("solution", "stub"):
        page = course / "feedback" / student / EXERCISE / f"{SOLUTION.stem}.html"
        assert page.is_file(), f"generate_feedback wrote no {page}"
        body = page.read_text(encoding="utf-8")
        assert "NotImplementedError" in body if student == "stub" else "NotImplementedError" not in body


def test_in_kernel_autograding_lets_a_submission_rebind_the_checks(course):
    """What docs/nbgrader.md warns about: nbgrader runs the hidden tests in the learner's kernel."""
    score, total = scores(course)["rebinds-check"]
    assert score == total, (
        f"a submission that rebinds check() scored {score}/{total}: if nbgrader now isolates the tests from the "
        "learner's namespace, update docs/nbgrader.md")


def test_zeroedu_grade_is_not_fooled_by_the_same_submission(course, tmp_path):
    """The contrast docs/nbgrader.md draws: zeroedu grade runs the test cells in its own process."""
    from zeroedu.grading import sandbox

    submission = course / "submitted" / "rebinds-check" / EXERCISE / SOLUTION.name
    folder = tmp_path / "rebinds-check"
    folder.mkdir()
    shutil.copy(submission, folder)
    report = tmp_path / "grades.json"
    trusted = [] if sandbox.check()[0] else ["--trusted"]  # the tests run in the grader either way
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "zeroedu", "grade", str(folder / SOLUTION.name), "--json",
                           str(report), *trusted], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert report.is_file(), f"zeroedu grade wrote no gradebook:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    learner = json.loads(report.read_text(encoding="utf-8"))["learners"][0]
    assert learner["max_points"] == full_marks(SOLUTION)
    assert learner["points"] == 0, f"zeroedu grade gave the check-rebinding stub {learner['points']} points"
