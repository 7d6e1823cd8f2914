"""`zeroedu build-exercises --release DIR`: the learner's folder holds every exercise and no solution text, no hidden
test and no grader metadata; searched line by line against the solutions themselves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from test_grading import _points

from zeroedu.grading import grader
from zeroedu.grading.notebook import strip_hidden

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroedu", "build-exercises", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _secret_lines(nb) -> set[str]:
    """Lines that only the solution has: inside BEGIN/END SOLUTION regions and hidden-test regions or cells,
    minus any line that also appears in the notebook's given cells (code or prose), which learners see anyway."""
    secret, given = set(), set()
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        inside = False
        for line in cell.source.splitlines():
            s = line.strip()
            if re.match(r"#+ ?(BEGIN|END) (SOLUTION|HIDDEN TESTS)", s):
                inside = s.lstrip("# ").startswith("BEGIN")
                continue
            if meta.get("solution") and cell.cell_type == "markdown":
                secret.add(s)
            elif inside:
                secret.add(s)
            else:
                given.add(s)
    # Short lines (return out, pass, a bracket) are not the answer; neither is what the given code says.
    return {s for s in secret - given if len(s) >= 16 and not s.startswith(("#", '"""'))}


def test_release_has_every_exercise_and_no_solution_text(tmp_path):
    out = tmp_path / "release"
    proc = _run("--release", str(out))
    assert proc.returncode == 0, proc.stderr
    solutions = {p.stem: nbformat.read(p, as_version=4) for p in sorted(SOLUTIONS.glob("ex*.ipynb"))}
    released = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert released == ["README.md", *(f"exercises/{name}.ipynb" for name in solutions)]
    texts = {name: (out / name).read_text(encoding="utf-8") for name in released}
    for name, nb in solutions.items():
        secrets = _secret_lines(nb)
        assert len(secrets) >= 3, name       # the search looks for something
        learner = nbformat.read(out / "exercises" / f"{name}.ipynb", as_version=4)
        body = "\n".join(c.source for c in learner.cells)
        # Its own notebook (file and cells) and the README: another exercise may show a common line in its given code.
        for text in (texts[f"exercises/{name}.ipynb"], texts["README.md"], body):
            leaked = [s for s in secrets if s in text or s.replace('"', '\\"') in text]
            assert not leaked, (name, leaked[:3])
        hidden_ids = {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
                      if c.metadata.get("nbgrader", {}).get("grade") and "BEGIN HIDDEN TESTS" in c.source
                      and not strip_hidden(c.source).strip().startswith("@check")}
        assert hidden_ids, name
        for text in texts.values():     # not even a placeholder names a wholly hidden test
            assert not any(g in text for g in hidden_ids), name
        # The grader's metadata is gone; the grade_ids that match a submission to its solution stay.
        assert "zeroedu" not in learner.metadata and "checksum" not in json_text(learner)
        ids = {c.metadata.get("nbgrader", {}).get("grade_id") for c in learner.cells} - {None}
        assert ids and ids <= {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells}
    for text in texts.values():
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text


def json_text(nb) -> str:
    return nbformat.writes(nb)


def test_release_refuses_a_folder_in_use(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    proc = _run("--release", str(tmp_path))
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    proc = _run("--release", str(SOLUTIONS / "out"))
    assert proc.returncode == 2 and "outside the solutions folder" in proc.stderr
    assert not (SOLUTIONS / "out").exists()


@pytest.mark.timeout(300)
def test_a_release_notebook_answered_right_scores_full_marks_hidden_tests_included(tmp_path):
    """The release drops the hidden tests' cells; the grader puts them back from solutions/ and runs them."""
    assert _run("--release", str(tmp_path / "release")).returncode == 0
    for name in ("ex01_memory_formulas", "ex09_choose_strategy"):
        solution = nbformat.read(SOLUTIONS / f"{name}.ipynb", as_version=4)
        answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
                   if c.metadata.get("nbgrader", {}).get("solution")}
        nb = nbformat.read(tmp_path / "release" / "exercises" / f"{name}.ipynb", as_version=4)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in answers:
                cell.source = answers[gid]
        path = tmp_path / "learner" / f"{name}.ipynb"
        path.parent.mkdir(exist_ok=True)
        nbformat.write(nb, str(path))
        [r] = grader.grade([path], SOLUTIONS, grader.Limits(cell_timeout=100), progress=False,
                           options=grader.Options(trusted=True))
        assert {t.grade_id for t in r.tests} == set(_points(name)), name     # hidden tests ran
        assert r.points == sum(_points(name).values()) and r.status == "graded", [(t.name, t.message) for t in r.tests]
