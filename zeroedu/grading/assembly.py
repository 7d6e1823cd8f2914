"""Which solution a submitted notebook is for (match_solution), and the notebook the grader runs (assemble): the
learner's answer cells, with every given and test cell restored from the solution, hidden tests included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from zeroedu.grading import notebook as nbtools
from zeroedu.grading.source import _by_grade_id, _defined, _methods, _norm


def _grade_ids(nb: Any) -> set[str]:
    return {gid for c in nb.cells if (gid := nbtools.nbgrader_meta(c).get("grade_id"))}


def match_solution(path: Path, nb: Any, solutions: dict[str, Any]) -> str | None:
    if path.stem in solutions:
        return path.stem
    ids = _grade_ids(nb)
    best = max(solutions, key=lambda s: len(ids & _grade_ids(solutions[s])), default=None)
    return best if best is not None and ids & _grade_ids(solutions[best]) else None



def assemble(submission: Any, solution: Any) -> Any:
    """The notebook to run: the learner's cells in the learner's order, answers kept, every other graded or
    locked cell replaced by the solution's (hidden tests included), missing ones put back where they were."""
    by_id = _by_grade_id(solution)
    stubs = _by_grade_id(nbtools.to_exercise(solution, ""))
    given = {_norm(s) for c in solution.cells if nbtools.cell_info(c).role in ("locked", "test")
             for s in (c.source, nbtools.strip_hidden(c.source))}
    cells: list[Any] = []
    used: set[str] = set()
    for cell in submission.cells:
        gid = nbtools.nbgrader_meta(cell).get("grade_id")
        if gid in by_id and gid not in used:
            used.add(gid)
            ref = by_id[gid]
            if nbtools.cell_info(ref).role == "answer":
                new = copy.deepcopy(ref)
                new.source = cell.get("source", "")
            else:
                new = copy.deepcopy(ref)
            cells.append(_tagged(new, gid))
        elif gid in by_id and nbtools.cell_info(by_id[gid]).role != "answer":
            continue  # a copied test or locked cell: run it once, from the solution
        elif cell.get("cell_type") == "code" and _norm(cell.get("source", "")) in given:
            continue  # a given or test cell that lost its metadata: it runs once, from the solution
        elif cell.get("cell_type") in ("code", "markdown"):
            new = copy.deepcopy(cell)
            new.metadata.pop("nbgrader", None)
            cells.append(_tagged(new, None))
    # Put back graded cells the learner deleted, after the solution cell that precedes them. An answer cell
    # whose names a cell of the learner's defines (a notebook that lost its nbgrader metadata) is that cell.
    for index, ref in enumerate(solution.cells):
        gid = nbtools.nbgrader_meta(ref).get("grade_id")
        if not gid or gid in used:
            continue
        used.add(gid)
        if nbtools.cell_info(ref).role == "answer" and ref.cell_type == "code":
            names = _defined(ref.source)
            mine = next((c for c in cells if c.metadata["zeroedu_grade"]["grade_id"] is None
                         and c.cell_type == "code" and names and names <= _defined(c.source)), None)
            if mine is not None:
                source = mine.source
                mine.clear()
                mine.update(copy.deepcopy(ref))
                mine.source = source
                _tagged(mine, gid)
                continue
        new = copy.deepcopy(stubs[gid] if nbtools.cell_info(ref).role == "answer" else ref)
        before = {g for c in solution.cells[:index] if (g := nbtools.nbgrader_meta(c).get("grade_id"))}
        position = 0
        for i, c in enumerate(cells):
            if c.metadata.get("zeroedu_grade", {}).get("grade_id") in before:
                position = i + 1
        cells.insert(position, _tagged(new, gid))
    nb = copy.deepcopy(solution)
    nb.cells = cells
    answers = [c.source for c in solution.cells if nbtools.cell_info(c).role == "answer" and c.cell_type == "code"]
    nb.metadata["zeroedu_grade"] = {"answer_names": sorted(set().union(*map(_defined, answers))),
                                    "answer_methods": sorted(set().union(*map(_methods, answers)))}
    for index, cell in enumerate(nb.cells):
        cell.id = f"graded-{index}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb



def _tagged(cell: Any, grade_id: str | None) -> Any:
    cell.metadata["zeroedu_grade"] = {"grade_id": grade_id}
    cell.pop("id", None)  # the learner's copy and the solution's may share ids
    return cell
