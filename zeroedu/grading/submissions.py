"""Which notebooks are graded, and whose: learners' folders (collect), the solutions (load_solutions), the exercise
each notebook is for (guess_exercise), each submission copied and hashed before any runs (stage), and only the
newest of a learner's copies of one exercise (newest_only)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
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
        if path.is_dir() and not path.is_symlink():
            found += [(path.resolve().name, p) for p in sorted(path.glob("*.ipynb"))]
            for sub in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                if sub.is_symlink():
                    found += [(sub.name, sub)]
                    continue
                found += [(sub.name, p) for p in _notebooks(sub)]
        elif path.is_symlink() or path.exists():   # a file, a FIFO, a device: stage() refuses what is not a file
            found.append((path.absolute().parent.name, path))
        else:
            raise FileNotFoundError(f"{path}: no such notebook or folder")
    return found


def load_solutions(folder: Path) -> dict[str, Any]:
    solutions = {p.stem: nbtools.read(p) for p in sorted(folder.glob("*.ipynb"))}
    if not solutions:
        raise FileNotFoundError(f"no solution notebooks in {folder}: pass --solutions DIR")
    return solutions


_EX_PREFIX = re.compile(r"^(ex\d+)", re.IGNORECASE)


MAX_NOTEBOOK_BYTES = 64 * 2**20   # a submission larger than this is refused unread (solutions are < 1 MB)


def guess_exercise(path: Path, solutions: dict[str, Any], read: bool = True) -> str | None:
    """The exercise a notebook is for, from the notebook (name, grade_ids) or, if unreadable, its file name.
    Only the grader's own copy is ever opened (read=True): a learner's path may be a FIFO, a link or a device,
    whose name says what it claims to be."""
    nb = None
    if read and not path.is_symlink():
        with contextlib.suppress(Exception):   # a malformed notebook is graded (and refused) later, not here
            nb = nbtools.read(path)
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
    """Copy every submission (once, before any is run) and hash it; refuse links, anything not a regular file
    (a FIFO would block the reader forever) and files over MAX_NOTEBOOK_BYTES."""
    out = []
    for k, (learner, path) in enumerate(pairs):
        sub = Submission(learner, path)
        data, sub.problem, sub.mtime = _read_submission(path)
        if data is not None:
            folder = into / f"{k:05d}"
            folder.mkdir(parents=True)
            sub.copy = folder / path.name
            sub.copy.write_bytes(data)
            sub.sha256 = hashlib.sha256(data).hexdigest()
        sub.exercise = guess_exercise(sub.copy or path, solutions, read=sub.copy is not None)
        out.append(sub)
    return out


def _read_submission(path: Path) -> tuple[bytes | None, str, float]:
    """(the bytes, '' , mtime), or (None, why it is refused, 0). Opened without following a link and without
    blocking (a FIFO), checked to be a regular file on the open descriptor, read up to the cap."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        if path.is_symlink():
            with contextlib.suppress(OSError):
                target = os.readlink(path)
                return None, (f"{path} is a symbolic link (to {target}): refused. Hand in the notebook itself, "
                              "not a link to it."), 0.0
        return None, f"cannot read {path}: {e.strerror or e}", 0.0
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file: refused", 0.0
        if st.st_size > MAX_NOTEBOOK_BYTES:
            return None, (f"{path} is {st.st_size} bytes, more than the grader reads ({MAX_NOTEBOOK_BYTES}): "
                          "refused; clear the notebook's outputs and hand it in again"), 0.0
        try:
            data = f.read(MAX_NOTEBOOK_BYTES + 1)
        except OSError as e:
            return None, f"cannot read {path}: {e.strerror or e}", 0.0
    if len(data) > MAX_NOTEBOOK_BYTES:   # it grew while read
        return None, f"{path} is more than {MAX_NOTEBOOK_BYTES} bytes: refused", 0.0
    return data, "", st.st_mtime


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
