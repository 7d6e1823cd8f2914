"""The instructor's outputs of `zeroedu grade`, added to its command line: --wide, --roster, --canvas, --moodle
(lms.py), --feedback (feedback.py) and --report (misconceptions.py). grader.main calls add_arguments, then
prepare (before any notebook runs: a bad roster costs nothing), outputs (paths the sandbox must hide), and
write once the gradebook is done."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroedu.grading import lms
from zeroedu.grading.results import ExerciseResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wide", type=Path, help="write one row per learner, a column per exercise and a total")
    parser.add_argument("--roster", type=Path,
                        help="CSV mapping submission folders to LMS ids (columns folder,id[,name,email,login,section])")
    parser.add_argument("--canvas", type=Path, help="write Canvas's gradebook import CSV here (needs --roster)")
    parser.add_argument("--moodle", type=Path, help="write Moodle's CSV grade import here (needs --roster)")
    parser.add_argument("--feedback", type=Path, help="write one HTML feedback page per learner into this folder")
    parser.add_argument("--report", type=Path,
                        help="write the class's misconception report here (Markdown; a .zh.md beside it in 中文)")


def prepare(args: argparse.Namespace) -> dict[str, lms.Learner] | None:
    """The roster, read and checked now; SystemExit(2) with the reason where the arguments cannot work."""
    if (args.canvas or args.moodle) and not args.roster:
        print("zeroedu grade: --canvas and --moodle need --roster FILE (a CSV of folder,id): an LMS matches "
              "grades by its own student ids, which the submission folders do not carry", file=sys.stderr)
        raise SystemExit(2)
    if not args.roster:
        return None
    try:
        return lms.read_roster(args.roster)
    except lms.RosterError as e:
        print(f"zeroedu grade: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def outputs(args: argparse.Namespace) -> list[Path]:
    return [p for p in (args.wide, args.canvas, args.moodle, args.feedback, args.report) if p is not None]


def write(args: argparse.Namespace, results: list[ExerciseResult], roster: dict[str, lms.Learner] | None) -> None:
    if args.wide:
        lms.write_wide(results, args.wide, roster)
    left: set[str] = set()
    if args.canvas:
        left.update(lms.write_canvas(results, args.canvas, roster or {}))
    if args.moodle:
        left.update(lms.write_moodle(results, args.moodle, roster or {}))
    for line in lms.lms_problems(results, roster):
        print(f"zeroedu grade: {line}", file=sys.stderr)
    if args.feedback:
        from zeroedu.grading import feedback

        for path in feedback.write_all(results, args.feedback, roster):
            print(f"wrote {path}", file=sys.stderr)
    if args.report:
        from zeroedu.grading import misconceptions

        for path in misconceptions.write_reports(results, args.report):
            print(f"wrote {path}", file=sys.stderr)
