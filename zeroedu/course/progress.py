"""`zeroedu progress [COURSE]`: which lessons you have run and which exercises pass, in one table (English, 中文).

Everything is read from your own files in the course folder (default: the current folder if it has notebooks/,
else the folder the zeroedu package lives in):
- a lesson notebooks/NN_*.ipynb counts as run when you saved it after running it: its code cells carry execution
  counts and its cells differ from the copy the course shipped (`git show HEAD:path`; the shipped notebooks hold
  saved outputs too, so counts alone would call every lesson run). Without git, counts alone decide ("saved with
  outputs").
- an exercise passes when your last self-grade (`zeroedu grade`, which writes exercises/.zeroedu-grades/NAME.json
  next to the notebook) gave full points, and the notebook has not changed since (its SHA-256 is kept with the
  grade).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GRADES = ".zeroedu-grades"


def course_root(given: str | None = None) -> Path:
    if given:
        return Path(given)
    here = Path.cwd()
    if (here / "notebooks").is_dir():
        return here
    return Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record_grade(notebook: Path, result: Any) -> Path:
    """Keep a self-grade next to the notebook for `zeroedu progress`: exercise, points, tests, when, file hash."""
    folder = notebook.parent / GRADES
    folder.mkdir(exist_ok=True)
    out = folder / f"{result.exercise}.json"
    out.write_text(json.dumps({
        "exercise": result.exercise, "notebook": notebook.name, "sha256": _sha256(notebook),
        "points": result.points, "max_points": result.max_points, "passed_tests": result.passed,
        "tests": len(result.tests), "status": result.status, "graded_at": time.strftime("%Y-%m-%d %H:%M"),
    }, indent=1) + "\n", encoding="utf-8")
    return out


def _code_cells(nb: dict) -> list[dict]:
    return [c for c in nb.get("cells", []) if c.get("cell_type") == "code"
            and "zeroedu-setup" not in c.get("metadata", {}).get("tags", [])]


def _shipped(root: Path, path: Path) -> dict | None:
    """The notebook as the course shipped it (git HEAD), or None where there is no git or no such file."""
    try:
        rel = path.resolve().relative_to(root.resolve()).as_posix()
        proc = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return None


def lesson_status(root: Path, path: Path) -> tuple[str, str]:
    """(status in English and Chinese, detail) for one lesson notebook."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return "unreadable 无法读取", f"{type(e).__name__}: {e}"
    cells = _code_cells(nb)
    ran = sum(c.get("execution_count") is not None for c in cells)
    counts = f"{ran}/{len(cells)} code cells with outputs"
    shipped = _shipped(root, path)
    if shipped is not None and _code_cells(shipped) == cells:
        return "not run 未运行", "as shipped (以课程原样)"
    if ran == 0:
        return "not run 未运行", counts
    if ran < len(cells):
        return "started 进行中", counts
    if shipped is None:
        return "saved with outputs 有输出", counts + " (no git: cannot tell from the shipped copy)"
    return "run 已运行", counts


def exercise_status(path: Path) -> tuple[str, str]:
    record = path.parent / GRADES / f"{path.stem}.json"
    if not record.is_file():
        return "not graded 未评分", f"python -m zeroedu grade {path.parent.name}/{path.name}"
    try:
        grade = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return "not graded 未评分", f"{record}: {e}"
    score = f"{grade['points']:g}/{grade['max_points']:g} points, {grade['passed_tests']}/{grade['tests']} tests"
    when = f"graded {grade['graded_at']}"
    if path.is_file() and _sha256(path) != grade["sha256"]:
        return "changed since graded 评分后已修改", f"{score}, {when}; grade again"
    if grade["status"] == "graded" and grade["points"] >= grade["max_points"] > 0:
        return "passes 通过", f"{score}, {when}"
    return "not yet 未通过", f"{score}, {when}"


def rows(root: Path) -> list[tuple[str, str, str, str]]:
    out = []
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        out.append(("lesson 课程", path.stem, *lesson_status(root, path)))
    for path in sorted((root / "exercises").glob("ex[0-9][0-9]_*.ipynb")):
        out.append(("exercise 练习", path.stem, *exercise_status(path)))
    return out


def table(found: list[tuple[str, str, str, str]]) -> str:
    head = ("kind 类型", "notebook 笔记本", "status 状态", "detail 说明")
    widths = [max(_width(r[i]) for r in [head, *found]) for i in range(3)]
    lines = []
    for row in [head, *found]:
        lines.append("  ".join(_pad(cell, w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return "\n".join(lines)


def _width(text: str) -> int:
    """Columns on a terminal: CJK characters take two."""
    return sum(2 if "\u2e80" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef" else 1 for ch in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - _width(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroedu progress", description="Which lessons you have run and which "
                                     "exercises pass, read from your own files (每课是否运行、每个练习是否通过).")
    parser.add_argument("course", nargs="?", default=None, help="the course folder (default: here, or zeroedu's)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    root = course_root(args.course)
    if not (root / "notebooks").is_dir():
        print(f"zeroedu progress: {root} has no notebooks/ folder; give the course folder: "
              "python -m zeroedu progress PATH", file=sys.stderr)
        return 2
    found = rows(root)
    if args.json:
        print(json.dumps([dict(zip(("kind", "notebook", "status", "detail"), r, strict=True)) for r in found],
                         ensure_ascii=False, indent=1))
        return 0
    print(table(found))
    lessons = [r for r in found if r[0].startswith("lesson")]
    exercises = [r for r in found if r[0].startswith("exercise")]
    print(f"\n{sum(r[2].startswith('run') for r in lessons)}/{len(lessons)} lessons run 课已运行, "
          f"{sum(r[2].startswith('passes') for r in exercises)}/{len(exercises)} exercises pass 练习已通过")
    return 0
