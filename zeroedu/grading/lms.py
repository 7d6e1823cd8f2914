"""Grades into a learning-management system: one row per learner, one column per exercise.

    zeroedu grade submissions/ --wide grades.csv                     # learner, id, one column per exercise, total
    zeroedu grade submissions/ --roster roster.csv --canvas canvas.csv --moodle moodle.csv

The roster maps the grader's learner names (each submission folder's name) to the LMS's student identifiers. It is
a CSV file with a header row: `folder` and `id` are required; `name`, `email`, `login` and `section` are optional
and copied into the columns the LMS reads. A folder that no roster row names is "not in roster"; a roster learner
with no folder is "no submission" and scores 0 on every exercise. Neither is ever dropped: the wide table keeps
both, and where an LMS file cannot hold a learner (no identifier to match), `lms_problems` names them so the
instructor sees them on the terminal.

The two LMS shapes, from their own documentation:
- Canvas (Grades > Import): one row per student, the columns Student, ID, SIS User ID, SIS Login ID and Section,
  then one column per assignment; a column whose name Canvas does not know becomes a new assignment
  (Ohio State's Canvas guide "Import a CSV file to Carmen Grades", teaching.resources.osu.edu). The roster's `id`
  goes in SIS User ID, and the Canvas ID column stays empty (Canvas matches on either).
- Moodle (Grades > Import > CSV file, grade/import/csv/classes/load_data.php in moodle/moodle): the instructor
  maps one column to the user by id, idnumber, email or username, and each other column to a grade item. A row
  whose user Moodle cannot find aborts the whole import, and a grade must be a number, so learners without a
  roster id are left out of this file (and named); each score is a plain number.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from zeroedu.grading.results import ExerciseResult

ROSTER_COLUMNS = ("folder", "id", "name", "email", "login", "section")


@dataclass
class Learner:
    folder: str                       # the grader's learner name: the submission folder
    id: str = ""                      # the LMS's identifier, from the roster
    name: str = ""
    email: str = ""
    login: str = ""
    section: str = ""
    status: str = "graded"            # graded | not in roster | no submission
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.scores.values())


class RosterError(ValueError):
    """A roster file the grader cannot use; the message names the row and the fix."""


def read_roster(path: Path) -> dict[str, Learner]:
    """folder -> Learner from a roster CSV (header row; `folder` and `id` required). Read before any grading, so
    a broken roster costs nothing."""
    try:
        text = path.read_text(encoding="utf-8-sig")   # a spreadsheet's UTF-8 export starts with a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise RosterError(f"cannot read the roster {path}: {e}; give a UTF-8 CSV file with a header row "
                          "folder,id[,name,email,login,section]") from None
    rows = list(csv.DictReader(text.splitlines()))
    header = [h.strip().lower() for h in (csv.DictReader(text.splitlines()).fieldnames or [])]
    missing = [c for c in ("folder", "id") if c not in header]
    if missing:
        raise RosterError(f"the roster {path} has no column {' or '.join(missing)} (its header is "
                          f"{','.join(header) or 'empty'}): the first row must name the columns, e.g. "
                          "folder,id,name,email")
    out: dict[str, Learner] = {}
    for n, row in enumerate(rows, start=2):
        clean = {k.strip().lower(): (v or "").strip() for k, v in row.items() if k is not None}
        if not any(clean.values()):
            continue                                  # a blank line
        folder, ident = clean.get("folder", ""), clean.get("id", "")
        if not folder or not ident:
            raise RosterError(f"the roster {path}, line {n}: folder and id must both be filled in "
                              f"(got folder={folder!r}, id={ident!r})")
        if folder in out:
            raise RosterError(f"the roster {path}, line {n}: folder {folder!r} is listed twice; each submission "
                              "folder belongs to one learner")
        out[folder] = Learner(folder, ident, *(clean.get(c, "") for c in ROSTER_COLUMNS[2:]))
    ids = [lr.id for lr in out.values()]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise RosterError(f"the roster {path} gives the id {twice[0]!r} to more than one folder: the LMS would "
                          "get two grades for one student")
    return out


def exercises_of(results: list[ExerciseResult]) -> dict[str, float]:
    """exercise -> its full points, in the order the gradebook lists them (unknown exercises left out)."""
    out: dict[str, float] = {}
    for r in sorted(results, key=lambda r: r.exercise):
        if r.max_points > 0:
            out.setdefault(r.exercise, r.max_points)
    return out


def learners(results: list[ExerciseResult], roster: dict[str, Learner] | None = None) -> list[Learner]:
    """Every learner once: those who handed something in (in the gradebook's order), then roster learners who
    handed in nothing. Scores are 0 for an exercise a learner did not hand in."""
    exercises = exercises_of(results)
    roster = roster or {}
    rows: dict[str, Learner] = {}
    for r in results:
        if r.learner not in rows:
            known = roster.get(r.learner)
            rows[r.learner] = (Learner(**{**known.__dict__, "scores": {}}) if known is not None
                               else Learner(r.learner, status="not in roster" if roster else "graded"))
        if r.exercise in exercises:
            rows[r.learner].scores[r.exercise] = rows[r.learner].scores.get(r.exercise, 0.0) + r.points
    for folder, known in roster.items():
        if folder not in rows:
            rows[folder] = Learner(**{**known.__dict__, "scores": {}, "status": "no submission"})
    for lr in rows.values():
        for ex in exercises:
            lr.scores.setdefault(ex, 0.0)
    return list(rows.values())


def _num(x: float) -> str:
    return f"{x:g}"


def _cell(text: str) -> str:
    """A spreadsheet opens a cell that starts with = + - @ as a formula: a learner's folder name must not be one
    (OWASP's CSV injection advice: prefix a quote)."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def write_wide(results: list[ExerciseResult], path: Path, roster: dict[str, Learner] | None = None) -> None:
    """One row per learner: folder, id, name, status, one column per exercise, total; the second row holds the
    points possible."""
    exercises = exercises_of(results)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "id", "name", "status", *exercises, "total"])
        w.writerow(["points possible", "", "", "", *map(_num, exercises.values()), _num(sum(exercises.values()))])
        for lr in learners(results, roster):
            w.writerow([_cell(lr.folder), _cell(lr.id), _cell(lr.name), lr.status,
                        *(_num(lr.scores[e]) for e in exercises), _num(lr.total)])


def write_canvas(results: list[ExerciseResult], path: Path, roster: dict[str, Learner]) -> list[str]:
    """Canvas's gradebook import; returns the learners it could not hold (no roster id)."""
    exercises = exercises_of(results)
    left: list[str] = []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *exercises])
        for lr in learners(results, roster):
            if not lr.id:
                left.append(lr.folder)
                continue
            w.writerow([_cell(lr.name or lr.folder), "", _cell(lr.id), _cell(lr.login), _cell(lr.section),
                        *(_num(lr.scores[e]) for e in exercises)])
    return left


def write_moodle(results: list[ExerciseResult], path: Path, roster: dict[str, Learner]) -> list[str]:
    """Moodle's CSV grade import (map `idnumber` or `email` to the user); returns the learners left out."""
    exercises = exercises_of(results)
    left: list[str] = []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["idnumber", "email", *exercises])
        for lr in learners(results, roster):
            if not lr.id:
                left.append(lr.folder)
                continue
            w.writerow([_cell(lr.id), _cell(lr.email), *(_num(lr.scores[e]) for e in exercises)])
    return left


def lms_problems(results: list[ExerciseResult], roster: dict[str, Learner] | None) -> list[str]:
    """What the instructor must see before importing: folders the roster does not know, roster learners with no
    submission."""
    if not roster:
        return []
    rows = learners(results, roster)
    lines = [f"not in the roster (no LMS id; left out of the Canvas/Moodle files): {lr.folder}"
             for lr in rows if lr.status == "not in roster"]
    lines += [f"no submission (0 on every exercise): {lr.folder} ({lr.id})"
              for lr in rows if lr.status == "no submission"]
    return lines
