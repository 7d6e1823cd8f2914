"""`python -m zeroedu.i18n status|extract|build [--execute] [NOTEBOOK ...]`: keep the Chinese edition in step.

    status            one line per translated lesson: up to date, or which cells moved
    extract NB ...    create or update notebooks/zh/po/NB.po from the English notebook (changed cells go fuzzy)
    build [NB ...]    write notebooks/zh/NB.ipynb from the English notebook and its catalogue; --execute runs it
                      (nbclient, in notebooks/zh/) so its saved outputs speak Chinese

NB is a lesson (00_start_here) or an exercise (ex01_memory_formulas): an exercise's catalogue is
notebooks/zh/po/NB.po (its cells are those of solutions/NB.ipynb), and build writes the Chinese exercise,
notebooks/zh/exercises/NB.ipynb (never executed; `--solution-to DIR` also writes the Chinese solution there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

from zeroedu.i18n import notebooks as ed


def _pick(names: list[str], default: list[Path]) -> list[Path]:
    if not names:
        return default
    picked = []
    for name in names:
        stem = Path(name).stem
        path = (ed.SOLUTIONS if stem.startswith("ex") else ed.NOTEBOOKS) / f"{stem}.ipynb"
        if not path.exists():
            raise SystemExit(f"no English notebook {path.parent.name}/{stem}.ipynb (give a name such as "
                             "00_start_here or ex01_memory_formulas)")
        picked.append(path)
    return picked


def _execute(nb: nbformat.NotebookNode, folder: Path, timeout: int) -> None:
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zeroedu.i18n", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["status", "extract", "build"])
    ap.add_argument("notebooks", nargs="*")
    ap.add_argument("--execute", action="store_true", help="build: run each Chinese notebook and save its outputs")
    ap.add_argument("--timeout", type=int, default=600, help="build --execute: seconds per cell")
    ap.add_argument("--solution-to", type=Path, default=None,
                    help="build: also write each exercise's Chinese solution (hidden tests included) into this folder")
    args = ap.parse_intermixed_args(argv)
    if args.command == "status":
        bad = 0
        for nb in _pick(args.notebooks, ed.translated_notebooks() + ed.translated_solutions()):
            status = ed.check(nb)
            bad += not status.ok
            print(status.describe())
        missing = [nb.stem for nb in ed.english_notebooks() + ed.solution_notebooks() if not ed.po_path(nb).exists()]
        if missing and not args.notebooks:
            print(f"no Chinese edition yet: {', '.join(missing)}")
        return 1 if bad else 0
    if args.command == "extract":
        if not args.notebooks:
            ap.error("extract: name the notebooks (e.g. 00_start_here)")
        for nb in _pick(args.notebooks, []):
            ed.po_path(nb).parent.mkdir(parents=True, exist_ok=True)
            po = ed.extract(nb)
            po.save(str(ed.po_path(nb)))
            todo = sum(1 for e in po if not e.obsolete and (not e.msgstr or "fuzzy" in e.flags))
            print(f"{ed.po_path(nb).relative_to(ed.ROOT)}: {len(po)} entries, {todo} to translate or review")
        return 0
    for nb in _pick(args.notebooks, ed.translated_notebooks() + ed.translated_solutions()):
        out = ed.zh_path(nb)
        if ed.is_solution(nb):
            zh = ed.build(nb)
            ed.write(ed.zh_exercise_path(nb), ed.build_exercise(nb, zh))
            print(ed.zh_exercise_path(nb).relative_to(ed.ROOT))
            if args.solution_to is not None:
                ed.write(args.solution_to / nb.name, zh)
                print(args.solution_to / nb.name)
            continue
        previous = nbformat.read(out, as_version=4) if out.exists() else None
        zh = ed.build(nb, previous)
        if args.execute:
            _execute(zh, out.parent, args.timeout)
        nbformat.write(zh, out)
        print(f"{out.relative_to(ed.ROOT)}" + (" (executed)" if args.execute else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
