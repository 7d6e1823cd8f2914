"""Exercise notebooks as nbgrader marks them: which cell is what, and how a solution becomes an exercise.

A solution notebook (solutions/*.ipynb) is the source of truth. Every code cell carries nbgrader metadata
(`metadata.nbgrader`: grade, solution, locked, points, grade_id, schema_version 3):

- answer cells (solution=True, grade=False): the learner's part sits between `### BEGIN SOLUTION` and
  `### END SOLUTION`. Text after the marker (`### BEGIN SOLUTION: sum the chunks around the ring`) becomes the
  message of the stub's NotImplementedError. An answer cell without markers is replaced whole.
- test cells (grade=True, locked=True, points): visible tests, and hidden tests between
  `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS` (a whole cell may be hidden).
- locked cells (locked=True): setup and given code; the grader restores them from the solution.

Markdown cells need no metadata. A cell tagged `grader-skip` (a slow demo, a timing) runs under nbval and in
JupyterLab but not when grading. `metadata.zeroedu.grader_setup` (notebook level, code) runs in the grader's
kernel before the first cell, under the start-up time limit rather than the per-cell one: imports, starting the
rank forkserver -- work that is not the learner's.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

BEGIN_SOLUTION, END_SOLUTION = "BEGIN SOLUTION", "END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
SKIP_TAG = "grader-skip"
HIDDEN_PLACEHOLDER = "# Hidden tests for this part run when the notebook is graded (zeroedu grade)."
TEXT_STUB = "YOUR ANSWER HERE"

_MARKER = re.compile(r"^(\s*)#+\s*(BEGIN SOLUTION|END SOLUTION|BEGIN HIDDEN TESTS|END HIDDEN TESTS)\b:?\s*(.*)$")
_DEF = re.compile(r"^(\s*)(?:async\s+)?(def|class)\s+(\w+)")


class NotebookFormatError(ValueError):
    """A solution notebook breaks the conventions above; the message names the notebook, the cell and the fix."""


@dataclass(frozen=True)
class CellInfo:
    role: str            # "answer", "test", "locked", "free" (no nbgrader metadata), "markdown"
    grade_id: str | None
    points: float
    hidden: bool         # a test cell with a hidden region


def nbgrader_meta(cell: Any) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def cell_info(cell: Any) -> CellInfo:
    meta = nbgrader_meta(cell)
    grade_id = meta.get("grade_id")
    if cell.get("cell_type") != "code" and not meta.get("solution"):
        return CellInfo("markdown", grade_id, 0.0, False)
    if meta.get("solution"):
        role = "answer"
    elif meta.get("grade"):
        role = "test"
    elif meta.get("locked"):
        role = "locked"
    else:
        role = "free"
    points = float(meta.get("points", 0) or 0) if role == "test" else 0.0
    hidden = role == "test" and any(m[1] == BEGIN_HIDDEN for m in _markers(cell.get("source", "")))
    return CellInfo(role, grade_id, points, hidden)


def _markers(source: str) -> list[tuple[int, str, str, str]]:
    """(line number, marker, indentation, trailing text) for every marker line."""
    out = []
    for i, line in enumerate(source.splitlines()):
        m = _MARKER.match(line)
        if m:
            out.append((i, m.group(2), m.group(1), m.group(3).strip()))
    return out


def read(path: str | Path) -> Any:
    return nbformat.read(str(path), as_version=4)


def write_text(nb: Any) -> str:
    """The notebook as nbformat writes it: sorted keys, one-space indent. Same input, same bytes."""
    return nbformat.writes(nb) + "\n"


# -- checking a solution notebook ---------------------------------------------------------------------------

def validate(nb: Any, name: str) -> None:
    """Raise NotebookFormatError unless `nb` follows the conventions in this module's docstring."""
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        info = cell_info(cell)
        if info.role == "markdown" and not nbgrader_meta(cell):
            continue
        if info.role == "free":
            raise NotebookFormatError(
                f"{where}: a code cell without nbgrader metadata. Give it metadata.nbgrader with a grade_id and "
                "locked=true (given code), solution=true (the learner's part) or grade=true with points (tests), "
                "so the grader knows whether to keep the learner's version or restore this one.")
        if not info.grade_id:
            raise NotebookFormatError(f"{where}: metadata.nbgrader has no grade_id; add a unique one like 'ex01-q2'.")
        if info.grade_id in seen:
            raise NotebookFormatError(f"{where}: grade_id {info.grade_id!r} is also used by cell "
                                      f"{seen[info.grade_id]}; grade_ids must be unique.")
        seen[info.grade_id] = index
        meta = nbgrader_meta(cell)
        if meta.get("solution") and meta.get("grade"):
            raise NotebookFormatError(f"{where}: solution and grade are both true (a manually graded answer); "
                                      "zeroedu grades automatically: split it into an answer cell and a test cell.")
        markers = _markers(cell.source)
        kinds = [m[1] for m in markers]
        if info.role == "answer":
            if BEGIN_HIDDEN in kinds or END_HIDDEN in kinds:
                raise NotebookFormatError(f"{where}: hidden tests in an answer cell; move them to a test cell.")
            _check_pairs(markers, BEGIN_SOLUTION, END_SOLUTION, where)
        elif info.role == "test":
            if BEGIN_SOLUTION in kinds or END_SOLUTION in kinds:
                raise NotebookFormatError(f"{where}: solution markers in a test cell; tests are never stubbed.")
            if not meta.get("points") or float(meta["points"]) <= 0:
                raise NotebookFormatError(f"{where}: a test cell needs points > 0 in metadata.nbgrader.points.")
            _check_pairs(markers, BEGIN_HIDDEN, END_HIDDEN, where)
            _check_points(cell.source, float(meta["points"]), where)
        elif markers:
            raise NotebookFormatError(f"{where}: markers in a locked cell; only answer and test cells have them.")


def _check_pairs(markers: list, begin: str, end: str, where: str) -> None:
    open_line = None
    for line, kind, _, _ in markers:
        if kind == begin:
            if open_line is not None:
                raise NotebookFormatError(f"{where}, line {line + 1}: '{begin}' inside another region "
                                          f"(opened on line {open_line + 1}); close it with '{end}' first.")
            open_line = line
        else:
            if open_line is None:
                raise NotebookFormatError(f"{where}, line {line + 1}: '{end}' without a '{begin}' before it.")
            open_line = None
    if open_line is not None:
        raise NotebookFormatError(f"{where}, line {open_line + 1}: '{begin}' is never closed with '{end}'.")


_CHECK_CALL = re.compile(r"\bcheck\(\s*(?:f?\"[^\"]*\"|f?'[^']*')\s*,\s*(?:points\s*=\s*)?([0-9.]+)")


def _check_points(source: str, points: float, where: str) -> None:
    """A test cell's check(...) calls must add up to its nbgrader points, or the printed score would lie."""
    found = [float(p) for p in _CHECK_CALL.findall(source)]
    if found and abs(sum(found) - points) > 1e-9:
        raise NotebookFormatError(f"{where}: the check(...) calls in this cell give {sum(found):g} points but "
                                  f"metadata.nbgrader.points is {points:g}; make them agree.")


# -- solution -> exercise ------------------------------------------------------------------------------------

def _stub_message(cell_source: str, line: int, text: str) -> str:
    """The marker's text, prefixed with the enclosing function's name, so a failing test names what to write."""
    lines = cell_source.splitlines()
    indent = len(lines[line]) - len(lines[line].lstrip())
    names: list[str] = []   # the enclosing def, then the classes around it: "Cls.method"
    for previous in reversed(lines[:line]):
        m = _DEF.match(previous)
        if m and len(m.group(1)) < indent and (not names or m.group(2) == "class"):
            names.insert(0, m.group(3))
            indent = len(m.group(1))
    if names:
        return f"{'.'.join(names)}: {text or 'write its body (see the docstring)'}"
    return text or "write this part (see the text above)"


def strip_solutions(source: str) -> str:
    """Replace each solution region by `raise NotImplementedError(...)`, indented like its BEGIN marker."""
    markers = _markers(source)
    lines = source.splitlines()
    if not any(m[1] == BEGIN_SOLUTION for m in markers):
        return "# YOUR CODE HERE\nraise NotImplementedError(\"write this cell (see the text above)\")"
    out: list[str] = []
    inside = False
    for i, line in enumerate(lines):
        m = _MARKER.match(line)
        if m and m.group(2) == BEGIN_SOLUTION:
            indent, message = m.group(1), _stub_message(source, i, m.group(3).strip())
            out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError({message!r})"]
            inside = True
        elif m and m.group(2) == END_SOLUTION:
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def strip_hidden(source: str) -> str:
    """Drop hidden regions, markers and all; what stays is the visible part of the test cell."""
    out: list[str] = []
    inside = False
    for line in source.splitlines():
        m = _MARKER.match(line)
        if m and m.group(2) == BEGIN_HIDDEN:
            inside = True
        elif m and m.group(2) == END_HIDDEN:
            inside = False
        elif not inside:
            out.append(line)
    text = "\n".join(out).strip("\n")
    return text if text.strip() else HIDDEN_PLACEHOLDER


def to_exercise(solution: Any, source_name: str) -> Any:
    """The learner's notebook: stubs for answers, hidden tests removed, outputs and execution data cleared."""
    nb = copy.deepcopy(solution)
    for cell in nb.cells:
        info = cell_info(cell)
        if info.role == "answer":
            cell.source = strip_solutions(cell.source) if cell.cell_type == "code" else TEXT_STUB
        elif info.role == "test":
            cell.source = strip_hidden(cell.source)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)   # nbclient's timestamps
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
        if info.role == "test":                 # nothing about the hidden tests survives in metadata
            cell.metadata.get("nbgrader", {}).pop("checksum", None)
    nb.metadata["zeroedu"] = {
        **nb.metadata.get("zeroedu", {}),
        "generated_from": source_name,
        "note": "generated by `zeroedu build-exercises`; edit the solution notebook instead",
    }
    return nb
