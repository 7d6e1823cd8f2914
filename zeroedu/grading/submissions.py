"""Which notebooks are graded, and whose: learners' folders (collect), the solutions (load_solutions), the exercise
each notebook is for (guess_exercise), each submission copied and hashed before any runs (stage), and only the
newest of a learner's copies of one exercise (newest_only)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroedu.grading import notebook as nbtools
from zeroedu.grading.assembly import match_solution


def _notebooks(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.ipynb")
                  if not any(part.startswith(".") for part in p.relative_to(folder).parts))


def collect(paths: list[Path]) -> list[tuple[str, Path]]:
    """(learner, notebook) pairs. A notebook: the learner is its folder's name. A folder: each subfolder is a
    learner; notebooks directly inside belong to the folder's own name. Symbolic links are returned too (the
    grader refuses them: a link can point at another learner's work or at the solution)."""
    found: list[tuple[str, Path]] = []
    for path in paths:
        if path.is_symlink() or path.is_file():
            found.append((path.absolute().parent.name, path))
        elif path.is_dir():
            found += [(path.resolve().name, p) for p in sorted(path.glob("*.ipynb"))]
            for sub in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                if sub.is_symlink():
                    found += [(sub.name, sub)]
                    continue
                found += [(sub.name, p) for p in _notebooks(sub)]
        else:
            raise FileNotFoundError(f"{path}: no such notebook or folder")
    return found


def load_solutions(folder: Path) -> dict[str, Any]:
    solutions = {p.stem: nbtools.read(p) for p in sorted(folder.glob("*.ipynb"))}
    if not solutions:
        raise FileNotFoundError(f"no solution notebooks in {folder}: pass --solutions DIR")
    return solutions


_EX_PREFIX = re.compile(r"^(ex\d+)", re.IGNORECASE)


def guess_exercise(path: Path, solutions: dict[str, Any]) -> str | None:
    """The exercise a notebook is for, from the notebook (name, grade_ids) or, if unreadable, its file name."""
    nb = None
    if not path.is_symlink():   # a link's name says what it claims to be; it is never opened
        with contextlib.suppress(Exception):
            nb = nbtools.read(path)
    if nb is not None:
        found = match_solution(path, nb, solutions)
        if found:
            return found
    if path.stem in solutions:
        return path.stem
    m = _EX_PREFIX.match(path.name)
    if m:
        hits = [s for s in solutions if s.lower().startswith(m.group(1).lower() + "_") or s.lower() == m.group(1)]
        if len(hits) == 1:
            return hits[0]
    return None


@dataclass
class Submission:
    learner: str
    path: Path                 # as handed in
    copy: Path | None = None   # the grader's copy, graded instead
    sha256: str = ""
    exercise: str | None = None
    mtime: float = 0.0
    problem: str = ""          # refused before grading


def stage(pairs: list[tuple[str, Path]], solutions: dict[str, Any], into: Path) -> list[Submission]:
    """Copy every submission (once, before any is run) and hash it; refuse links and anything not a file."""
    out = []
    for k, (learner, path) in enumerate(pairs):
        sub = Submission(learner, path)
        if path.is_symlink():
            sub.problem = (f"{path} is a symbolic link (to {os.readlink(path)}): refused. Hand in the notebook "
                           "itself, not a link to it.")
        elif not path.is_file():
            sub.problem = f"{path} is not a regular file: refused"
        else:
            try:
                data = path.read_bytes()
                sub.mtime = path.stat().st_mtime
            except OSError as e:
                sub.problem = f"cannot read {path}: {e.strerror or e}"
            else:
                folder = into / f"{k:05d}"
                folder.mkdir(parents=True)
                sub.copy = folder / path.name
                sub.copy.write_bytes(data)
                sub.sha256 = hashlib.sha256(data).hexdigest()
        sub.exercise = guess_exercise(sub.copy or path, solutions)
        out.append(sub)
    return out


def newest_only(subs: list[Submission]) -> tuple[list[Submission], dict[int, list[Submission]]]:
    """One submission per learner and exercise: the newest (by modification time, then path); the others are
    returned by the id of the one graded instead."""
    groups: dict[tuple[str, str], list[Submission]] = {}
    keep: list[Submission] = []
    for sub in subs:
        if sub.exercise is None or sub.problem:
            keep.append(sub)
            continue
        groups.setdefault((sub.learner, sub.exercise), []).append(sub)
    dropped: dict[int, list[Submission]] = {}
    for group in groups.values():
        group.sort(key=lambda s: (s.mtime, str(s.path)))
        keep.append(group[-1])
        if len(group) > 1:
            dropped[id(group[-1])] = group[:-1]
    order = {id(s): i for i, s in enumerate(subs)}
    keep.sort(key=lambda s: order[id(s)])
    return keep, dropped
