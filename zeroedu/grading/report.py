"""The gradebook: results as a table for the terminal, as JSON (gradebook) and as CSV (write_csv)."""

from __future__ import annotations

import csv
import unicodedata
from dataclasses import asdict
from pathlib import Path

from zeroedu.grading.results import ExerciseResult

# The marks of the grader's own verdicts ("✓ name (2/2)", "✗ name (0/2): hint"). Only the grader writes them
# where the instructor and the learner read results: in every string that came from a notebook (its names, its
# printed output, its exceptions, what its process reported) safe() and unmark() write them out as \u2713 and
# \u2717, so a line that shows one was written by the grader.
GRADER_MARKS = "\u2713\u2717"


def safe(text: str, newlines: bool = True) -> str:
    """`text` with every control and format character written out (\\x1b, \\u202e...): a learner's file name or
    message must not move the instructor's cursor, recolour the terminal, reorder a line or start a fake row.
    Newlines and tabs stay in messages (newlines=True), never in names. The grader's marks (GRADER_MARKS) are
    written out too: no learner string can pass for a verdict."""
    out = []
    for ch in str(text):
        if ch in "\n\t" and newlines:
            out.append(ch)
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") or ch in GRADER_MARKS:
            out.append(ascii(ch)[1:-1])
        else:
            out.append(ch)
    return "".join(out)


def unmark(text: str) -> str:
    """A notebook's printed output with the grader's marks written out (the rest left as printed)."""
    return "".join(ascii(ch)[1:-1] if ch in GRADER_MARKS else ch for ch in str(text))


def sanitise(results: list[ExerciseResult]) -> None:
    """Every learner-controlled string of the results through safe(), in place: before the table, JSON and CSV."""
    for r in results:
        r.learner, r.exercise, r.path = safe(r.learner, False), safe(r.exercise, False), safe(r.path, False)
        r.notes = [safe(n, False) for n in r.notes]   # one line each: no forged row
        for t in r.tests:
            t.name, t.message = safe(t.name), safe(t.message)


def _num(x: float) -> str:
    return f"{x:g}"


def table(results: list[ExerciseResult], width: int = 70) -> str:
    rows = [("learner", "exercise", "points", "tests", "first failure")]
    for r in results:
        failure = safe(r.first_failure.replace("\n", " ").replace("\t", " "), newlines=False)
        rows.append((safe(r.learner, False), safe(r.exercise, False), f"{_num(r.points)}/{_num(r.max_points)}",
                     f"{r.passed}/{len(r.tests)}" if r.status == "graded" else r.status,
                     (failure[:width - 1] + "…") if len(failure) > width else (failure or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
             for row in rows]
    totals: dict[str, list[float]] = {}
    for r in results:
        t = totals.setdefault(r.learner, [0.0, 0.0])
        t[0] += r.points
        t[1] += r.max_points
    if len(results) > 1:
        lines.append("")
        lines += [f"{safe(learner, False)}: {_num(p)}/{_num(m)}" for learner, (p, m) in totals.items()]
    return "\n".join(lines)


def gradebook(results: list[ExerciseResult]) -> dict:
    learners: dict[str, dict] = {}
    for r in results:
        entry = learners.setdefault(r.learner, {"learner": r.learner, "points": 0.0, "max_points": 0.0,
                                                "exercises": []})
        entry["points"] += r.points
        entry["max_points"] += r.max_points
        d = asdict(r)
        d["passed_tests"], d["first_failure"] = r.passed, r.first_failure
        entry["exercises"].append(d)
    return {"learners": list(learners.values())}


CSV_FIELDS = ["learner", "exercise", "points", "max_points", "passed_tests", "tests", "status", "first_failure",
              "notes"]


def write_csv(results: list[ExerciseResult], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow({"learner": r.learner, "exercise": r.exercise, "points": _num(r.points),
                        "max_points": _num(r.max_points), "passed_tests": r.passed, "tests": len(r.tests),
                        "status": r.status, "first_failure": r.first_failure,
                        # one note a line: a note is one line (sanitise), so none can pass for two
                        "notes": "\n".join(r.notes)})
