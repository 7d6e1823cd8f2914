"""`zeroedu grade PATH... [--json F] [--csv F] [--timeout S] [--trusted]`: grade exercise notebooks.

    zeroedu grade exercises/ex01_memory_formulas.ipynb     # one notebook
    zeroedu grade submissions/ --json grades.json --csv grades.csv
                                     # submissions/<learner>/*.ipynb, one folder per learner

How a notebook is graded:
1. Every submission is copied and hashed before any runs; symbolic links are refused, and of several copies of
   one exercise by one learner only the newest is graded (the others are named in its notes). A notebook is
   matched to solutions/<same name>.ipynb (or, if renamed, to the solution sharing most nbgrader grade_ids).
   The learner's answer cells are kept; every test and locked cell is restored from the solution, hidden tests
   included; a notebook that lost its nbgrader metadata has its cells matched by content.
2. The learner's cells run in a fresh python3 kernel (nbclient) inside a bubblewrap sandbox (sandbox.py), cell
   by cell. The tests do not: each test cell runs in this process, where the learner's names are proxies
   (remote.py). Calling one asks the kernel to call the learner's object, and only plain data comes back,
   through two named pipes, loaded with torch.load(weights_only=True) (kernel.py). Harness code marks what must
   run next to the learner's code with in_kernel(...) (training on ranks, for instance); references, expected
   values and checks are computed here. Hidden test sources never reach the kernel. A test cell scores its
   nbgrader points when it runs here without error, else zero with the first error in plain words.
3. While a notebook is graded, the engine pieces its exercise asks for (solution metadata zeroedu.write_your_own)
   raise "write your own" whenever learner code reaches them (kernel.apply_blocks, applied by
   guard/sitecustomize.py in every Python process of the sandbox). Before that, forged_answers reads the
   learner's cells here: an answer cell must define its template's functions and classes with def/class (each
   class writing the asked methods in its own body) and no cell may bind an answer name again; such a cell is
   not run (MyStage1 = Stage1, class MyStage1(Stage1): pass).
4. Limits: --timeout seconds per cell (the kernel is interrupted; if it ignores that, its whole sandbox is
   killed and a fresh kernel replays the cells that had run), --notebook-timeout for the whole notebook
   (kernel start-up and the notebook's `grader_setup` code are not counted), --max-output bytes of output kept
   and characters per message, and in the sandbox memory, processes and CPU time per process. launch() inside
   a test gets a few seconds less than the cell (ZEROEDU_TEST_TIMEOUT), so deadlocked ranks end with launch's
   own report of which rank is not in the collective.

5. One notebook never costs the others: whatever goes wrong while it is graded (the grader's own code failing on
   a malformed notebook included) gives that notebook 0 with the reason, status "grader error", and the run goes
   on; a FIFO, a link or a file over MAX_NOTEBOOK_BYTES is refused unread; every scratch folder is removed on
   every exit path (SIGTERM included) by scratch.remove_tree, and every learner-controlled string is escaped
   (report.safe) before the table, the JSON and the CSV.

Without bubblewrap, grading refuses unless --trusted is given: then there is no sandbox, only the audit hook of
guard/sitecustomize.py, which stops accidents, not attacks (for learners grading their own notebooks).

This module is the entry: grade_notebook, grade, main and Options. The steps live in their own modules:
submissions (which notebooks, whose; copied and hashed), assembly (the notebook to run), source (what is read
from the cells without running them: where each runs, forged answers), runner (the kernel, cell by cell, with
client for nbclient and link for a test cell's pipes to the kernel), score (the verdicts), results (the result
types) and report (the gradebook as a table, JSON and CSV). The names other code imports from here are
re-exported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroedu.grading import notebook as nbtools
from zeroedu.grading.assembly import assemble, match_solution
from zeroedu.grading.build import default_dir
from zeroedu.grading.client import _cut
from zeroedu.grading.link import kernel_exchange
from zeroedu.grading.report import CSV_FIELDS, gradebook, safe, sanitise, table, unmark, write_csv
from zeroedu.grading.results import CellRun, ExerciseResult, Limits, TestResult
from zeroedu.grading.runner import _Runner
from zeroedu.grading.score import _refusals, full_points, score
from zeroedu.grading.scratch import remove_tree
from zeroedu.grading.source import forged_answers, grader_names, places, shadowed_engine_names
from zeroedu.grading.submissions import Submission, collect, guess_exercise, load_solutions, newest_only, stage
from zeroedu.i18n import LANGUAGES, current, speaking, tr

__all__ = ["CSV_FIELDS", "CellRun", "ExerciseResult", "Limits", "Options", "Submission", "TestResult", "assemble",
           "collect", "default_options", "forged_answers", "full_points", "grade", "grade_notebook", "gradebook",
           "grader_names", "guess_exercise", "kernel_exchange", "load_solutions", "main", "match_solution",
           "newest_only", "places", "score", "shadowed_engine_names", "stage", "table", "write_csv"]


@dataclass
class Options:
    """How notebooks are run: in a sandbox (bubblewrap; hidden: paths no sandbox may see) or --trusted."""

    trusted: bool = False
    hidden: list[Path] = field(default_factory=list)
    sandbox_limits: Any = None


def default_options(solutions_dir: Path | None, inputs: list[Path], executed: Path | None) -> Options:
    """The sandbox, with solutions and the run's inputs and outputs hidden: what grade() and grade_notebook()
    use unless given Options(trusted=True). RuntimeError where bubblewrap cannot run."""
    from zeroedu.grading import sandbox as sb

    ok, why = sb.check()
    if not ok:
        raise RuntimeError(f"no sandbox: {why}: {sb.INSTALL_HINT} (the Python API: options=Options(trusted=True))")
    solutions = (solutions_dir or default_dir("solutions")).resolve()
    return Options(trusted=False, hidden=sb.hidden_paths(solutions, list(inputs),
                                                         [executed] if executed is not None else []))


def grade_notebook(path: Path, learner: str, solutions: dict[str, Any], limits: Limits,
                   scratch: Path, executed: Path | None = None, options: Options | None = None,
                   shown_as: str | None = None) -> ExerciseResult:
    """Grade one notebook (a copy the grader made: `shown_as` is the submission's own path, for the report), in
    the language the notebook declares (metadata zeroedu.language, "zh" in notebooks/zh/), else the grader's."""
    options = options or default_options(None, [path], executed)
    t0 = time.monotonic()
    shown = shown_as or str(path)
    result = ExerciseResult(learner, path.stem, shown)
    try:
        submission = nbtools.read(path)
    except Exception as e:
        result.status = "unreadable"
        why = f"{type(e).__name__}: {_cut(str(e), 300)}"
        result.notes.append(tr(f"cannot read {shown} as a notebook: {why}",
                               f"无法把 {shown} 当作 notebook 读取：{why}"))
        return result
    meta = submission.metadata.get("zeroedu")
    declared = meta.get("language") if isinstance(meta, dict) else None   # "zh" in the Chinese edition
    result.language = declared if declared in LANGUAGES else current()
    with speaking(result.language):   # the check names, hints and notes of this notebook, in its language
        return _grade_read(path, submission, result, solutions, limits, scratch, executed, options, shown, t0)


def _grade_read(path: Path, submission: Any, result: ExerciseResult, solutions: dict[str, Any], limits: Limits,
                scratch: Path, executed: Path | None, options: Options, shown: str, t0: float) -> ExerciseResult:
    from zeroedu.grading import sandbox as sb

    learner = result.learner
    name = match_solution(path, submission, solutions)
    if name is None:
        result.status = "unknown exercise"
        known = ", ".join(sorted(solutions))
        result.notes.append(tr(f"{Path(shown).name} matches no notebook in the solutions folder (by name or by "
                               f"nbgrader grade_ids); known: {known}",
                               f"{Path(shown).name} 与 solutions 文件夹里的任何 notebook 都对不上（按文件名或 nbgrader "
                               f"grade_id）；已有的是：{known}"))
        return result
    result.exercise = name
    nb = assemble(submission, solutions[name])
    for i, why in forged_answers(nb, solutions[name]).items():
        nb.cells[i].metadata["zeroedu_grade"]["refused"] = _cut(why, limits.max_output)
    folders = [Path(tempfile.mkdtemp(prefix=p, dir=scratch)) for p in ("nb-", "grader-", "ipc-")]
    workdir, private, ipc = folders
    box = None
    try:
        shutil.copyfile(path, workdir / Path(shown).name)
        blocks = solutions[name].metadata.get("zeroedu", {}).get("write_your_own", [])
        (private / "config.json").write_text(json.dumps({"blocks": blocks}), encoding="utf-8")
        if not options.trusted:
            box = sb.Sandbox(workdir, ipc, private / "config.json", options.hidden,
                             options.sandbox_limits or sb.Limits())
        runner = _Runner(nb, workdir, private, limits, box)
        runner.run()
        refusals = _refusals(private)
    finally:   # the learner's copy goes as soon as its notebook is graded, whatever happened
        if box is not None:
            box.close()
        for folder in folders:
            remove_tree(folder)
    result.tests, notes = score(nb, runner.runs)
    result.notes = notes + runner.notes + refusals
    if runner.truncated:
        result.notes.append(tr(f"printed more than {limits.max_output} bytes; the rest of the output was dropped",
                               f"输出超过了 {limits.max_output} 字节；其余输出已丢弃"))
    result.notes += shadowed_engine_names(nb, submission)
    result.points = sum(t.points for t in result.tests)
    result.max_points = full_points(solutions[name])
    result.seconds = round(time.monotonic() - t0, 1)
    _cap_messages(result, limits.max_output)
    if executed is not None:
        _unmark_kernel_outputs(nb)
        out = executed / learner / f"{name}.ipynb"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(nbtools.write_text(nb), encoding="utf-8")
    return result


def _unmark_kernel_outputs(nb: Any) -> None:
    """In the executed notebook the instructor reads, the grader's marks (✓, ✗) appear only in the outputs of
    cells the grader ran (tests): in what the learner's cells printed they are written out (report.unmark)."""
    for cell, where in zip(nb.cells, places(nb), strict=True):
        if where not in ("kernel", "both"):
            continue
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = unmark("".join(output["text"]) if isinstance(output["text"], list)
                                        else output["text"])
            for key, value in (output.get("data") or {}).items():
                if key.startswith("text/"):
                    output["data"][key] = unmark("".join(value) if isinstance(value, list) else value)
            if "evalue" in output:
                output["evalue"] = unmark(output["evalue"])
                output["traceback"] = [unmark(line) for line in output.get("traceback", [])]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cap_messages(result: ExerciseResult, limit: int) -> None:
    result.notes = [_cut(n, limit) for n in result.notes]
    for t in result.tests:
        t.message = _cut(t.message, limit)



def grade(paths: list[Path], solutions_dir: Path, limits: Limits, executed: Path | None = None,
          progress: bool = True, options: Options | None = None, jobs: int = 1) -> list[ExerciseResult]:
    solutions = load_solutions(solutions_dir)
    options = options or default_options(solutions_dir, paths, executed)
    pairs = collect(paths)
    results: list[ExerciseResult] = []
    scratch = tempfile.mkdtemp(prefix="zeroedu-grade-")
    try:
        subs, dropped = newest_only(stage(pairs, solutions, Path(scratch) / "submissions"))

        def one(sub: Submission) -> ExerciseResult:
            try:
                return graded(sub)
            except Exception as e:   # the grader's own failure on this notebook: 0 for it, the others go on
                r = ExerciseResult(sub.learner, sub.exercise or sub.path.stem, str(sub.path), "grader error")
                where = traceback.extract_tb(e.__traceback__)[-1]
                at = f"{type(e).__name__}: {e}, at {Path(where.filename).name}:{where.lineno}"
                r.notes.append(_cut(tr(f"the grader could not grade this notebook ({at}); it scores 0: check that it "
                                       "is the exercise notebook you were given, or ask your instructor",
                                       f"评分器无法给这个 notebook 评分（{at}）；记 0 分：请确认它就是发给你的练习 "
                                       "notebook，或者问问你的老师"),
                                    limits.max_output))
                if sub.exercise in solutions:
                    r.max_points = full_points(solutions[sub.exercise])
                return r

        def graded(sub: Submission) -> ExerciseResult:
            if sub.problem or sub.copy is None:
                r = ExerciseResult(sub.learner, sub.exercise or sub.path.stem, str(sub.path), "refused")
                r.notes.append(_cut(sub.problem, limits.max_output))
            else:
                if progress:
                    print(safe(f"grading {sub.learner}: {sub.path}", False), file=sys.stderr, flush=True)
                r = grade_notebook(sub.copy, sub.learner, solutions, limits, Path(scratch), executed, options,
                                   shown_as=str(sub.path))
                r.sha256 = sub.sha256
            if r.status != "graded" and sub.exercise in solutions:
                r.exercise = sub.exercise
                r.max_points = full_points(solutions[sub.exercise])   # 0 of the full points, not 0 of 0
            for old in dropped.get(id(sub), []):
                r.notes.append(tr(f"also handed in: {old.path} (older than {sub.path}; only the newest is graded)",
                                  f"还交了：{old.path}（比 {sub.path} 旧；只给最新的一份评分）"))
            return r

        if jobs > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                results = list(pool.map(one, subs))
        else:
            results = [one(sub) for sub in subs]
    finally:
        left = remove_tree(Path(scratch))
        if left and progress:
            print(f"zeroedu grade: {left}", file=sys.stderr)
    learners = list(dict.fromkeys(learner for learner, _ in pairs))
    if len(learners) > 1:  # a gradebook: every learner gets a row for every exercise someone handed in
        seen = list(dict.fromkeys(r.exercise for r in results if r.exercise in solutions))
        for learner in learners:
            have = {r.exercise for r in results if r.learner == learner}
            for ex in seen:
                if ex not in have:
                    results.append(ExerciseResult(learner, ex, "", "not submitted", 0.0, full_points(solutions[ex]),
                                                  notes=["no notebook for this exercise"]))
        order = {name: i for i, name in enumerate(learners)}
        results.sort(key=lambda r: (order[r.learner], r.exercise))
    sanitise(results)
    return results



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroedu grade", description="Grade exercise notebooks against "
                                     "solutions/: hidden tests included, each notebook in its own sandbox.")
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="a notebook, or a folder (one subfolder per learner)")
    parser.add_argument("--solutions", type=Path, default=None, help="solution notebooks (default: solutions/)")
    parser.add_argument("--json", type=Path, help="write the gradebook as JSON here")
    parser.add_argument("--csv", type=Path, help="write the gradebook as CSV here (one row per learner and exercise)")
    parser.add_argument("--timeout", type=float, default=Limits.cell_timeout, help="seconds per cell (default 120)")
    parser.add_argument("--notebook-timeout", type=float, default=Limits.notebook_timeout,
                        help="seconds per notebook (default 900)")
    parser.add_argument("--max-output", type=int, default=Limits.max_output,
                        help="bytes of output kept per notebook, and characters per message (default 1000000)")
    parser.add_argument("--executed", type=Path, default=None,
                        help="also save each executed notebook here, hidden tests included (for instructors)")
    parser.add_argument("--trusted", action="store_true",
                        help="run without the sandbox: only for your own notebooks on your own machine")
    parser.add_argument("--memory-gb", type=float, default=6.0,
                        help="address space per sandboxed process, GiB (default 6)")
    parser.add_argument("--notebook-memory-gb", type=float, default=8.0,
                        help="memory of a notebook's processes together, where the host lets the grader make a cgroup "
                             "(default 8)")
    parser.add_argument("--max-processes", type=int, default=1024,
                        help="processes and threads in the sandboxes (default 1024)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks graded at once (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    from zeroedu.grading import kit

    kit.add_arguments(parser)   # --wide, --roster, --canvas, --moodle, --feedback, --report
    args = parser.parse_args(argv)
    roster = kit.prepare(args)
    if args.timeout <= 0 or args.notebook_timeout <= 0:
        parser.error("--timeout and --notebook-timeout must be > 0 seconds")
    if args.max_output < 100 or args.jobs < 1 or args.memory_gb <= 0 or args.max_processes < 16:
        parser.error("--max-output must be >= 100, --jobs >= 1, --memory-gb > 0, --max-processes >= 16")
    from zeroedu.grading import sandbox as sb

    options = Options(trusted=args.trusted)
    if not args.trusted:
        ok, why = sb.check()
        if not ok:
            print(f"zeroedu grade: no sandbox: {why}; refusing to run untrusted notebooks: {sb.INSTALL_HINT}.",
                  file=sys.stderr)
            return 3
        solutions_dir = (args.solutions or default_dir("solutions")).resolve()
        outputs = [p for p in (args.json, args.csv, args.executed) if p is not None] + kit.outputs(args)
        options.hidden = sb.hidden_paths(solutions_dir, list(args.paths), outputs)
        if not args.quiet:
            print(f"zeroedu grade: {sb.cgroup_note()}", file=sys.stderr)
        options.sandbox_limits = sb.Limits(memory=int(args.memory_gb * 2**30), processes=args.max_processes,
                                           cpu_seconds=int(2 * args.notebook_timeout + 600),
                                           notebook_memory=int(args.notebook_memory_gb * 2**30))
    limits = Limits(args.timeout, args.notebook_timeout, args.max_output)
    # Stopped from outside (timeout(1), a scheduler): unwind, so that scratch copies are removed.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        results = grade(args.paths, args.solutions or default_dir("solutions"), limits, args.executed,
                        progress=not args.quiet, options=options, jobs=args.jobs)
    except FileNotFoundError as e:
        print(f"zeroedu grade: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not results:
        print("zeroedu grade: no notebooks found in " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(gradebook(results), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.csv:
        write_csv(results, args.csv)
    kit.write(args, results, roster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
