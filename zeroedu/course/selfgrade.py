"""Grading your own exercise: `zeroedu grade exercises/ex01_memory_formulas.ipynb`, or `zeroedu.grade()` in a cell.

Whose code runs decides how it runs. One notebook file that belongs to you (the user running the grader), in your
exercises/ folder or named with --mine, is your own work: its cells run as you, with your permissions, as they
did when you ran them in JupyterLab, so the grader runs it without the sandbox and says so. Anything else (a
folder of submissions, several notebooks, a file owned by someone else or outside exercises/, or `--sandbox`) is
other people's work and runs in the bubblewrap sandbox, or not at all where bubblewrap is missing (the grader says
why and how to install it). One notebook prints one line per test with its whole message (the hint), then the
score; `--json`/`--csv` and folders keep the gradebook table (grading/grader.py).

`zeroedu.grade()` runs `python -m zeroedu grade` with this kernel's own Python, so it works with or without an
activated venv. It grades the notebook as last saved: save it first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from zeroedu.grading.results import ExerciseResult

BULK_FLAGS = {"--json", "--csv", "--executed", "--jobs", "--memory-gb", "--max-processes", "--wide", "--roster",
              "--canvas", "--moodle", "--feedback", "--report"}


def own_notebook(paths: list[Path], extra: list[str], anywhere: bool = False) -> Path | None:
    """The single notebook of yours that the arguments name, else None (bulk grading, or someone else's). Yours:
    a file you own in an exercises/ folder (your working copy of the course; an instructor's submissions/alice/
    is not one), or anywhere with --mine (what zeroedu.grade() passes: the notebook whose kernel calls it)."""
    if len(paths) != 1 or any(a.split("=")[0] in BULK_FLAGS for a in extra):
        return None
    path = paths[0]
    if not path.is_file() or path.is_symlink() or path.suffix != ".ipynb":
        return None
    if path.stat().st_uid != os.getuid():
        return None
    return path if anywhere or path.resolve().parent.name == "exercises" else None


def details(result: ExerciseResult) -> str:
    """One line per test (PASS/FAIL, points, name, then the full message, indented), then the score."""
    lines = [f"{result.exercise}: {result.path}"]
    if result.status != "graded":
        lines.append(f"  {result.status}")
    for t in result.tests:
        verdict = "PASS" if t.passed else "FAIL"
        hidden = " (hidden test)" if t.hidden else ""
        lines.append(f"  {verdict}  {_num(t.points)}/{_num(t.max_points)}  {t.name}{hidden}")
        for line in (t.message or "").strip().splitlines():
            lines.append(f"        {line}")
    for note in result.notes:
        lines.append(f"  note: {note}")
    lines.append(f"score: {_num(result.points)}/{_num(result.max_points)} ({result.passed} of {len(result.tests)} "
                 f"tests passed, {result.seconds:.0f} s)")
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:g}"


def main(argv: list[str] | None = None) -> int:
    """`zeroedu grade`: your own single notebook here, without the sandbox; everything else to grading/grader.py."""
    from zeroedu.grading import grader

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--sandbox", action="store_true")
    parser.add_argument("--mine", action="store_true")
    parser.add_argument("--trusted", action="store_true")
    parser.add_argument("--solutions", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=grader.Limits.cell_timeout)
    parser.add_argument("--notebook-timeout", type=float, default=grader.Limits.notebook_timeout)
    parser.add_argument("--max-output", type=int, default=grader.Limits.max_output)
    parser.add_argument("--quiet", action="store_true")
    if any(a in {"-h", "--help"} for a in argv):
        return _help(grader)
    if "--hints" in argv:      # every hint of every check, for instructors
        from zeroedu.grading import hints

        return hints.main([a for a in argv if a.startswith("--lang=")])
    args, extra = parser.parse_known_args(argv)
    one = len(args.paths) == 1 and args.paths[0].is_file() and not extra
    if not one:                                    # folders, several notebooks, --json/--csv: the gradebook
        return grader.main([a for a in argv if a not in {"--sandbox", "--mine"}])
    if args.trusted or args.sandbox:
        return _one(args, trusted=args.trusted and not args.sandbox)
    mine = own_notebook(args.paths, extra, anywhere=args.mine)
    if mine is not None:
        print(f"zeroedu grade: {mine} is your own notebook: it runs as you, without the sandbox, "
              "as it ran in JupyterLab. Other people's work runs in the sandbox: give their folder, or add "
              "--sandbox.", flush=True)
    return _one(args, trusted=mine is not None)


def _one(args: argparse.Namespace, trusted: bool) -> int:
    from zeroedu.grading import grader
    from zeroedu.grading.build import default_dir

    limits = grader.Limits(args.timeout, args.notebook_timeout, args.max_output)
    if args.timeout <= 0 or args.notebook_timeout <= 0:
        print("zeroedu grade: --timeout and --notebook-timeout must be > 0 seconds", file=sys.stderr)
        return 2
    solutions = args.solutions or default_dir("solutions")
    try:
        options = grader.Options(trusted=True) if trusted else grader.default_options(solutions, args.paths, None)
    except RuntimeError as e:
        print(f"zeroedu grade: {e}. This notebook is not yours (or --sandbox was given), so it runs only in the "
              "sandbox; your own notebook runs without it.", file=sys.stderr)
        return 3
    try:
        results = grader.grade(args.paths, solutions, limits, progress=not args.quiet, options=options)
    except FileNotFoundError as e:
        print(f"zeroedu grade: {e}", file=sys.stderr)
        return 2
    if not results:
        print(f"zeroedu grade: no notebook found at {args.paths[0]}", file=sys.stderr)
        return 2
    print(details(results[0]))
    if trusted and results[0].status == "graded":   # your own work: kept for `zeroedu progress`
        from zeroedu.course.progress import record_grade

        record_grade(args.paths[0], results[0])
        from zeroedu.grading import hints  # one more hint per failed check, each time it fails again

        # in the notebook's language (the Chinese edition's), as its checks spoke
        for line in hints.progressive(results[0], hints.record_failures(args.paths[0], results[0]),
                                      results[0].language):
            print(line)
    return 0


def _help(grader) -> int:
    print("usage: zeroedu grade NOTEBOOK            your own notebook (yours, in exercises/; or --mine): no sandbox,\n"
          "                                        one line per test with its hint, then the score\n"
          "       zeroedu grade NOTEBOOK --sandbox  someone else's notebook: in the sandbox, in the same detail\n"
          "       zeroedu grade FOLDER... [--json F] [--csv F]   bulk: every learner's notebooks, sandboxed\n"
          "       zeroedu grade --hints [--lang=en|zh]  every progressive hint of every check (instructors)\n")
    try:
        grader.main(["--help"])
    except SystemExit:
        pass
    return 0


def _notebook_here() -> Path | None:
    """The notebook this kernel runs, where the front end says: JupyterLab/jupyter_server (JPY_SESSION_NAME) or
    VS Code (__vsc_ipynb_file__)."""
    name = os.environ.get("JPY_SESSION_NAME")
    if name and name.endswith(".ipynb"):
        return Path(name)
    try:
        from IPython import get_ipython

        shell = get_ipython()
        vsc = shell.user_ns.get("__vsc_ipynb_file__") if shell is not None else None
    except ImportError:
        vsc = None
    return Path(vsc) if vsc else None


def resolve(notebook: str | os.PathLike) -> Path:
    """A path as given if it exists; else a name ('ex01_memory_formulas', with or without .ipynb) looked up in
    exercises/ here, one folder up (a lesson's kernel runs in notebooks/) and next to the zeroedu package."""
    path = Path(notebook)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".ipynb" else path.name + ".ipynb"
    package_root = Path(__file__).resolve().parents[2]
    for folder in (Path.cwd(), Path.cwd() / "exercises", Path.cwd().parent / "exercises", package_root / "exercises"):
        if (folder / name).is_file():
            return folder / name
    return path


def grade(notebook: str | os.PathLike | None = None, *, sandbox: bool = False) -> int:
    """Grade an exercise notebook (default: the one this kernel runs, as last saved) and print each test's verdict
    and hint, then the score. Runs `python -m zeroedu grade` with this kernel's Python; returns its exit status."""
    path = resolve(notebook) if notebook is not None else _notebook_here()
    if path is None:
        raise ValueError("zeroedu.grade(): which notebook? This front end does not say; pass its name, e.g. "
                         "zeroedu.grade('ex01_memory_formulas')")
    if not path.is_file():
        raise FileNotFoundError(f"zeroedu.grade(): no notebook at {path.resolve()}; pass the path of your saved "
                                "exercise notebook")
    age = time.time() - path.stat().st_mtime
    print(f"grading {path} as saved {age:.0f} s ago (save first, Ctrl+S, to grade your latest edits)", flush=True)
    cmd = [sys.executable, "-m", "zeroedu", "grade", str(path), "--quiet", "--sandbox" if sandbox else "--mine"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:      # streamed, so a long grading shows its lines as they come
        print(line, end="", flush=True)
    return proc.wait()
