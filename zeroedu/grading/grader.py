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

Without bubblewrap, grading refuses unless --trusted is given: then there is no sandbox, only the audit hook of
guard/sitecustomize.py, which stops accidents, not attacks (for learners grading their own notebooks).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import copy
import csv
import hashlib
import io
import json
import logging
import os
import pickle
import re
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from zeroedu.grading import notebook as nbtools
from zeroedu.grading import remote
from zeroedu.grading.build import default_dir

GUARD_DIR = Path(__file__).resolve().parent / "guard"
REFUSED_MARK = "zeroedu-grade-refused "   # guard/sitecustomize.py writes refusals after it
PROBE_SECONDS = 10.0      # after a timeout, how long an interrupted kernel gets to answer again (loaded machines)
MAX_RESTARTS = 3          # fresh kernels per notebook after kills or crashes
TIMEOUT_ENAME = "GraderTimeout"
REFUSED_ENAME = "RefusedByGrader"   # a cell the grader would not run (forged_answers)
STARTUP_SECONDS = 180     # kernel start plus the set-up code: importing torch on a loaded machine is slow
DEFAULT_SETUP = "import zeroedu.grading"
# Runs in the kernel before anything else: caps what print() can push through ZeroMQ at the source, so a
# runaway loop of prints costs the grader little even before its own cap (in _Client.output) drops the rest.
OUTPUT_CAP = """
import sys as _sys

def _zeroedu_cap(stream, budget):
    write, left = stream.write, [budget]
    def capped(text):
        if left[0] <= 0:
            return len(text)
        left[0] -= len(text)
        return write(text if left[0] >= 0 else text[:left[0] + len(text)])
    stream.write = capped

_zeroedu_cap(_sys.stdout, {budget})
_zeroedu_cap(_sys.stderr, {budget})


def _zeroedu_short_errors(budget):
    # An exception's message and traceback are cut here, before they are sent: a 100 MB message raised at the
    # top level of a cell would otherwise cross ZeroMQ whole, twice (the error output and the execute reply).
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return

    def short(self, etype, value, tb, tb_offset=None):
        try:
            text = str(value)
        except BaseException:
            text = "(its message could not be printed)"
        if len(text) > budget:
            cut = text[:budget] + f" [... {{len(text) - budget}} more characters cut by the grader]"
            try:
                value.args = (cut,)
                ok = len(str(value)) <= budget + 100
            except BaseException:
                ok = False
            if not ok:
                value = type(etype.__name__, (Exception,), {{}})(cut)
                etype = type(value)
            result = getattr(self.displayhook, "exec_result", None)
            if result is not None:
                result.error_in_exec = value
        try:
            stb = self.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        except BaseException:
            stb = [f"{{etype.__name__}}: {{str(value)[:budget]}}"]
        kept, left = [], budget
        for line in stb[-200:]:
            kept.append(line[:max(0, left)])
            left -= len(kept[-1])
        self._showtraceback(etype, value, kept)
        return kept

    shell.set_custom_exc((BaseException,), short)


_zeroedu_short_errors({budget})
del _zeroedu_cap, _zeroedu_short_errors, _sys
"""


@dataclass
class TestResult:
    grade_id: str
    name: str
    points: float
    max_points: float
    passed: bool
    message: str = ""
    hidden: bool = False


@dataclass
class ExerciseResult:
    learner: str
    exercise: str
    path: str
    status: str = "graded"     # graded | not submitted | unknown exercise | unreadable | refused
    points: float = 0.0
    max_points: float = 0.0
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    sha256: str = ""           # of the submission as handed in (the grader graded a copy)

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def first_failure(self) -> str:
        if self.status != "graded":
            return self.notes[0] if self.notes else self.status
        failed = next((t for t in self.tests if not t.passed), None)
        return f"{failed.name}: {failed.message}" if failed else ""


@dataclass
class CellRun:
    status: str                 # ok | error | timeout | killed | died | skipped | not run
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0


@dataclass
class Limits:
    cell_timeout: float = 120.0
    notebook_timeout: float = 900.0
    max_output: int = 1_000_000


# -- which solution, and the notebook to run ---------------------------------------------------------------

def _grade_ids(nb: Any) -> set[str]:
    return {gid for c in nb.cells if (gid := nbtools.nbgrader_meta(c).get("grade_id"))}


def match_solution(path: Path, nb: Any, solutions: dict[str, Any]) -> str | None:
    if path.stem in solutions:
        return path.stem
    ids = _grade_ids(nb)
    best = max(solutions, key=lambda s: len(ids & _grade_ids(solutions[s])), default=None)
    return best if best is not None and ids & _grade_ids(solutions[best]) else None


def _by_grade_id(nb: Any) -> dict[str, Any]:
    return {gid: c for c in nb.cells if (gid := nbtools.nbgrader_meta(c).get("grade_id"))}


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


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def _defined(source: str) -> set[str]:
    """Names a cell's top level binds (def, class, import, assignment, for)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def _methods(source: str) -> set[str]:
    """Names defined inside the classes of a cell."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {item.name for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}


def _loaded(source: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    except SyntaxError:
        return set()


def _shape(source: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """A cell's top-level def and class names ({name: "def"|"class"}) and each class's methods."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}, {}
    kinds: dict[str, str] = {}
    methods: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kinds[node.name] = "def"
        elif isinstance(node, ast.ClassDef):
            kinds[node.name] = "class"
            methods[node.name] = {item.name for item in node.body
                                  if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return kinds, methods


def _module_bindings(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """Every binding of a module-level name in a cell: at its top level (in if/for/with/try too), and through
    `global` inside functions."""
    out: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Global):
                out.extend((name, child) for name in child.names)
            if not top:
                visit(child, False)
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.append((child.name, child))
                visit(child, False)
            elif isinstance(child, ast.Lambda):
                visit(child, False)
            elif isinstance(child, ast.Import | ast.ImportFrom):
                out.extend(((a.asname or a.name).split(".")[0], child) for a in child.names)
            elif isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store | ast.Del):
                out.append((child.id, child))
            elif isinstance(child, ast.NamedExpr) and isinstance(child.target, ast.Name):
                out.append((child.target.id, child))
                visit(child, True)
            else:
                visit(child, True)

    visit(tree, True)
    return out


def forged_answers(nb: Any, solution: Any) -> dict[int, str]:
    """Cells of an assembled notebook that the grader refuses to run, and why. Checked here, on the source, so
    nothing in the kernel can talk the grader out of it:
    - an answer cell must define each function and class its template defines, with `def` or `class` (not
      `MyStage1 = Stage1`, not a partial of zeroedu's function), each class with every method of the template
      written in its own body;
    - no cell of the learner's may bind one of those names a second time (a later `MyStage1 = Stage1`, a
      `global` in a function)."""
    stubs = {gid: c for gid, c in _by_grade_id(nbtools.to_exercise(solution, "")).items()
             if nbtools.cell_info(c).role == "answer" and c.cell_type == "code"}
    asked = {gid: _shape(c.source) for gid, c in stubs.items()}
    owner = {name: gid for gid, (kinds, _) in asked.items() for name in kinds}
    seen: dict[str, str] = {}
    problems: dict[int, str] = {}
    for i, (cell, where) in enumerate(zip(nb.cells, places(nb), strict=True)):
        if where != "kernel" or cell.cell_type != "code":
            continue
        gid = cell.metadata.get("zeroedu_grade", {}).get("grade_id")
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue   # it fails in the kernel, with Python's own message
        why: list[str] = []
        bindings = _module_bindings(tree)
        if gid in asked:
            kinds, methods = _shape(cell.source)
            bound = {name for name, _ in bindings}
            for name, kind in asked[gid][0].items():
                if name not in bound:
                    continue   # never defined: the tests say "not defined", with what this cell did instead
                if kinds.get(name) != kind:
                    why.append(f"it must define {name} with a `{kind} {name}` statement, as the template does")
                elif kind == "class":
                    missing = sorted(asked[gid][1][name] - methods[name])
                    if missing:
                        why.append(f"class {name} must write {', '.join(missing)} in its own body (the "
                                   "methods this exercise asks for)")
        for name, node in bindings:
            if name not in owner:
                continue
            first = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and gid == owner[name] \
                and name not in seen
            if first:
                seen[name] = gid
            elif not any(name in w for w in why):
                why.append(f"it binds {name} again (line {getattr(node, 'lineno', '?')}), which the answer cell "
                           f"'{owner[name]}' defines: an answer name is defined once, by its answer cell")
        if why:
            what = f"answer cell '{gid}'" if gid in asked else "cell you added"
            problems[i] = f"zeroedu grade refused to run this {what}: " + "; ".join(why) + "."
    return problems


def places(nb: Any) -> list[str]:
    """Where each cell of an assembled notebook runs when graded: "kernel" (the learner's answers and added
    cells), "both" (given set-up code the answers need: the cells before the first answer, and those defining
    names an answer uses, unless they use the learner's names), "grader" (tests and every other given cell: they
    run here, on proxies of the learner's objects), or "" (markdown)."""
    answers = set(nb.metadata.get("zeroedu_grade", {}).get("answer_names", []))
    roles = [nbtools.cell_info(c).role if c.metadata.get("zeroedu_grade", {}).get("grade_id") else
             ("free" if c.cell_type == "code" else "markdown") for c in nb.cells]
    first_answer = next((i for i, r in enumerate(roles) if r == "answer"), len(roles))
    needed = set().union(*(_loaded(c.source) for c, r in zip(nb.cells, roles, strict=True) if r == "answer"))
    out = []
    for i, (cell, role) in enumerate(zip(nb.cells, roles, strict=True)):
        if role == "markdown" or cell.cell_type != "code":
            out.append("")
        elif role == "test":
            out.append("grader")
        elif role == "locked":
            setup = i < first_answer or bool(_defined(cell.source) & needed)
            out.append("both" if setup and not _loaded(cell.source) & answers else "grader")
        else:
            out.append("kernel")
    return out


def grader_names(nb: Any) -> set[str]:
    """Names that the cells run by the grader bind: never looked up in the learner's kernel."""
    return set().union(*(_defined(c.source) for c, where in zip(nb.cells, places(nb), strict=True)
                         if where in ("grader", "both")))


def _tagged(cell: Any, grade_id: str | None) -> Any:
    cell.metadata["zeroedu_grade"] = {"grade_id": grade_id}
    cell.pop("id", None)  # the learner's copy and the solution's may share ids
    return cell


# -- running ---------------------------------------------------------------------------------------------

_QUIET = logging.getLogger("zeroedu.grading.nbclient")  # nbclient logs timeouts as errors; we report them ourselves
_QUIET.setLevel(logging.CRITICAL)


class _Client(NotebookClient):
    """nbclient with a cap on the output it keeps: a learner printing gigabytes costs us nothing."""

    def __init__(self, nb: Any, max_output: int, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self.max_output = max_output
        self.output_bytes = 0
        self.truncated = False

    def output(self, outs: list, msg: dict, display_id: str | None, cell_index: int) -> Any:
        content = msg.get("content", {})
        size = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
        room = self.max_output - self.output_bytes
        self.output_bytes += size
        if msg.get("msg_type") == "error":  # errors are how tests fail: always keep them, cut to max_output
            cut = {**content, "ename": str(content.get("ename", ""))[:200],
                   "evalue": _cut(str(content.get("evalue", "")), self.max_output), "traceback": []}
            left = self.max_output
            for line in content.get("traceback", [])[-200:]:
                cut["traceback"].append(str(line)[:max(0, left)])
                left -= len(cut["traceback"][-1])
            return super().output(outs, {**msg, "content": cut}, display_id, cell_index)
        if size <= room:
            return super().output(outs, msg, display_id, cell_index)
        if self.truncated:
            return None
        self.truncated = True
        if msg.get("msg_type") == "stream" and room > 0:  # keep the start of the text that crosses the limit
            msg = {**msg, "content": {**content, "text": content["text"][:room]}}
            super().output(outs, msg, display_id, cell_index)
        outs.append(nbformat.v4.new_output("stream", name="stderr", text=(
            f"\n[zeroedu grade: output cut here; the notebook printed more than {self.max_output} bytes]\n")))
        return None


class _LogPipe:
    """A pipe for the kernel's stdout and stderr, copied into a file by a thread of the grader: the guard's
    refusals written there stay, whatever the learner's code does to its own file descriptors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        read, self.fd = os.pipe()
        self.thread = threading.Thread(target=self._drain, args=(read,), daemon=True, name="zeroedu-kernel-log")
        self.thread.start()

    def _drain(self, read: int) -> None:
        with open(self.path, "ab") as out, open(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                out.write(chunk)
                out.flush()

    def started(self) -> None:
        """The kernel has its copy: close ours, so the pipe ends when the kernel and its children do."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.started()
        self.thread.join(timeout=2.0)


class _Runner:
    """Runs one assembled notebook: one kernel (or a fresh one after a kill), one cell at a time."""

    def __init__(self, nb: Any, workdir: Path, private: Path, limits: Limits, sandbox: Any = None) -> None:
        self.nb = nb
        self.workdir = workdir
        self.private = private
        self.limits = limits
        self.sandbox = sandbox
        self.places = places(nb)
        self.ns = remote.Namespace(grader_names(nb))   # names the grader's own cells define are never the learner's
        self.client: _Client | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kernel_lost = False
        self.grader_error = ""
        self.runs: list[CellRun] = [CellRun("not run") for _ in nb.cells]
        self.notes: list[str] = []
        self.truncated = False
        self.t0 = time.monotonic()
        self.pgid: int | None = None
        self.log_offset = 0

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        tmp = self.workdir / ".tmp"
        tmp.mkdir(exist_ok=True)
        env.update(
            ZEROEDU_GRADE_ROOT=str(self.workdir), ZEROEDU_GRADE_CONFIG=str(self.private / "config.json"),
            PYTHONPATH=os.pathsep.join([str(GUARD_DIR), *filter(None, [env.get("PYTHONPATH")])]),
            TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg",
            # launch() inside a test gives up a little before the cell would be killed: a clearer message.
            ZEROEDU_TEST_TIMEOUT=f"{self.test_timeout():g}",
        )
        env.pop("JPY_PARENT_PID", None)
        return env

    def test_timeout(self) -> float:
        """Seconds a launch() inside a test may take: a few seconds under the cell's limit, so that launch can
        stop its ranks and say which line each waits on before the grader interrupts the cell."""
        t = self.limits.cell_timeout
        return max(1.0, min(0.75 * t, t - 3.0))

    def left(self) -> float:
        return self.limits.notebook_timeout - (time.monotonic() - self.t0)

    def run(self) -> None:
        start = 0
        for attempt in range(MAX_RESTARTS + 1):
            start = asyncio.run(self._session(start, replay=attempt > 0))
            if start >= len(self.nb.cells):
                return
            if self.left() <= 0:
                break
        for i in range(start, len(self.nb.cells)):
            if self.runs[i].status == "not run" and self.nb.cells[i].cell_type == "code":
                self.runs[i] = CellRun("not run", evalue="the kernel was restarted too often")

    async def _session(self, start: int, replay: bool) -> int:
        """Run cells from `start` in a fresh kernel; return where to resume if the kernel had to go."""
        client = _Client(self.nb, self.limits.max_output, log=_QUIET, kernel_name="python3", allow_errors=True,
                         interrupt_on_timeout=True, record_timing=False, iopub_timeout=2,
                         resources={"metadata": {"path": str(self.workdir)}}, startup_timeout=STARTUP_SECONDS)
        replies: dict[int, dict] = {}

        def on_executed(cell: Any, cell_index: int, execute_reply: dict | None) -> None:
            if execute_reply is not None:
                replies[cell_index] = execute_reply.get("content", {})

        client.on_cell_executed = on_executed
        self.client, self.loop, self.kernel_lost = client, asyncio.get_running_loop(), False
        log = _LogPipe(self.private / "kernel.log")  # the kernel's stdout and stderr: a pipe it cannot rewind
        self.pgid = None
        env = self.env()
        if self.sandbox is not None:
            env = self.sandbox.env(env)
            self.sandbox.prepare()
            client.km = self.sandbox.kernel_manager(client)
        try:
            async with client.async_setup_kernel(env=env, stdout=log.fd, stderr=log.fd):
                log.started()
                self.pgid = getattr(client.km.provisioner, "pgid", None)
                problem = await self._setup(client)
                if problem:
                    self.notes.append(problem)
                    for j in range(start, len(self.nb.cells)):
                        self.runs[j] = CellRun("not run", evalue=problem)
                    return len(self.nb.cells)
                if not replay:
                    self.t0 = time.monotonic()  # the notebook's clock starts with its first cell, not the kernel
                if replay:
                    for i in range(start):
                        if self.runs[i].status == "ok" and self.places[i] in ("kernel", "both"):
                            status = await self._kernel_cell(client, replies, i, record=False)
                            if status in ("killed", "died"):
                                return start  # try again in another fresh kernel (MAX_RESTARTS bounds it)
                for i in range(start, len(self.nb.cells)):
                    if self.left() <= 0:
                        self.notes.append(f"the notebook ran past its {self.limits.notebook_timeout:g} s limit: "
                                          f"cells from {i} on did not run")
                        for j in range(i, len(self.nb.cells)):
                            self.runs[j] = CellRun("not run", evalue=(
                                f"the notebook ran past its {self.limits.notebook_timeout:g} s limit"))
                        return len(self.nb.cells)
                    status = await self._execute(client, replies, i)
                    if status in ("killed", "died"):
                        return i + 1
            return len(self.nb.cells)
        except DeadKernelError:
            return start + 1
        finally:
            self.truncated |= client.truncated
            self._kill()  # whatever the kernel started in its process group goes too
            log.close()

    def _kill(self) -> None:
        if self.pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            self.pgid = None

    def _role(self, i: int) -> str:
        cell = self.nb.cells[i]
        return nbtools.cell_info(cell).role if cell.metadata.get("zeroedu_grade", {}).get("grade_id") else (
            "markdown" if cell.cell_type != "code" else "free")

    async def _execute(self, client: _Client, replies: dict, i: int, record: bool = True) -> str:
        cell = self.nb.cells[i]
        if cell.cell_type != "code" or not cell.source.strip():
            return "ok"
        if nbtools.SKIP_TAG in cell.metadata.get("tags", []):
            self.runs[i] = CellRun("skipped")
            return "ok"
        refused = cell.metadata.get("zeroedu_grade", {}).get("refused")
        if refused:
            self.runs[i] = CellRun("error", REFUSED_ENAME, refused)
            cell.outputs = [nbformat.v4.new_output("error", ename=REFUSED_ENAME, evalue=refused, traceback=[])]
            return "error"
        if self.places[i] == "grader":
            return await self._grader_cell(i)
        status = await self._kernel_cell(client, replies, i, record)
        if self.places[i] == "both" and status == "ok":
            here = await self._grader_cell(i, record=False)
            if here != "ok":
                self.notes.append(f"the given cell {self._label(i)} failed in the grader: {self.grader_error}")
        return status

    async def _grader_cell(self, i: int, record: bool = True) -> str:
        """Run a test (or a given cell that uses the learner's names) in this process, on proxies of the
        learner's objects; only plain data comes back from the kernel."""
        cell = self.nb.cells[i]
        gid = cell.metadata.get("zeroedu_grade", {}).get("grade_id") or f"cell {i}"
        code = compile(cell.source, f"<zeroedu grader: {gid}>", "exec")
        out = io.StringIO()
        deadline = time.monotonic() + max(1.0, min(self.limits.cell_timeout, self.left()))
        link = _KernelLink(self, deadline)
        t0 = time.monotonic()

        def work() -> CellRun:
            remote.set_session(link)
            _Captured.install()
            _Captured.local.buffer = out
            try:
                exec(code, self.ns)
                return CellRun("ok", seconds=time.monotonic() - t0)
            except Exception as e:
                return CellRun("error", type(e).__name__, _cut(str(e), self.limits.max_output),
                               time.monotonic() - t0)
            finally:
                link.close()
                remote.set_session(None)
                _Captured.local.buffer = None

        run = await asyncio.to_thread(work)
        if link.status in ("timeout", "killed", "died"):
            run = CellRun(link.status, evalue=link.detail, seconds=run.seconds)
        text = out.getvalue()
        if record:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=_cut(text, self.limits.max_output))] \
                if text else []
            if run.status == "error":
                cell.outputs.append(nbformat.v4.new_output("error", ename=run.ename, evalue=run.evalue, traceback=[]))
            self.runs[i] = run
        self.grader_error = f"{run.ename}: {run.evalue}" if run.status == "error" else run.status
        return "killed" if link.status in ("killed", "died") else ("ok" if run.status == "ok" else run.status)

    async def serve(self, token: str, deadline: float) -> tuple[str, str]:
        """Run kernel.serve(token) in the kernel while a test cell talks to it; (status, detail) at its end."""
        code = f"__import__('zeroedu.grading.kernel', fromlist=['serve']).serve({token!r})"
        cell = nbformat.v4.new_code_cell(code)
        replies: dict[int, dict] = {}
        client = self.client
        assert client is not None
        first = self.nb.cells[0]  # async_execute_cell stores the cell it ran at the index it is given
        timeout = max(1.0, deadline - time.monotonic())
        client.timeout = int(timeout + 0.999)
        client.error_on_timeout = {"ename": TIMEOUT_ENAME, "evalue": f"{timeout:g}", "traceback": []}
        saved = client.on_cell_executed
        client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.update(
            {0: (execute_reply or {}).get("content", {})})
        try:
            await client.async_execute_cell(cell, 0)
        except DeadKernelError:
            return "died", self._kernel_tail()
        finally:
            client.on_cell_executed = saved
            self.nb.cells[0] = first
        reply = replies.get(0, {})
        if reply.get("ename") == TIMEOUT_ENAME:
            if not await self._responsive(client):
                self._kill()
                return "killed", f"{timeout:.0f}"
            return "timeout", f"{timeout:.0f}"
        return "ok", ""

    async def _kernel_cell(self, client: _Client, replies: dict, i: int, record: bool = True) -> str:
        cell = self.nb.cells[i]
        timeout = max(1.0, min(self.limits.cell_timeout, self.left()))
        client.timeout = int(timeout + 0.999)
        client.error_on_timeout = {"ename": TIMEOUT_ENAME, "evalue": f"{timeout:g}", "traceback": []}
        replies.pop(i, None)
        t0 = time.monotonic()
        self.log_offset = self._log_size()
        try:
            await client.async_execute_cell(cell, i)
        except DeadKernelError:
            run = CellRun("died", evalue=self._kernel_tail())
            if record:
                self.runs[i] = run
            return "died"
        reply = replies.get(i, {})
        run = CellRun("ok", seconds=time.monotonic() - t0)
        if reply.get("status") == "error":
            run = CellRun("error", str(reply.get("ename", ""))[:200], _cut(str(reply.get("evalue", "")),
                                                                         self.limits.max_output), run.seconds)
        if run.ename == TIMEOUT_ENAME:
            run.status = "timeout"
            if not await self._responsive(client):
                run.status = "killed"
                self._kill()
        if record:
            self.runs[i] = run
        return run.status

    async def _setup(self, client: _Client) -> str:
        """Run the notebook's grader_setup code (imports, the forkserver) before any learner cell: start-up time
        is not the learner's, so it gets STARTUP_SECONDS, not the per-cell limit. Returns a problem or ''."""
        code = self.nb.metadata.get("zeroedu", {}).get("grader_setup") or DEFAULT_SETUP
        # +1: the grader's own cap must see the crossing to note it; the kernel's only stops the flood
        cell = nbformat.v4.new_code_cell(OUTPUT_CAP.format(budget=self.limits.max_output + 1) + "\n" + code)
        first = self.nb.cells[0]
        client.timeout = STARTUP_SECONDS
        client.interrupt_on_timeout = False
        try:
            await client.async_execute_cell(cell, 0)
        except Exception as e:  # CellTimeoutError, DeadKernelError
            return f"the grader's set-up code did not run in the kernel ({type(e).__name__}: {str(e)[:200]})"
        finally:
            client.interrupt_on_timeout = True
            self.nb.cells[0] = first
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if errors:
            return f"the grader's set-up code failed: {errors[0]['ename']}: {errors[0]['evalue']}"
        return ""

    async def _responsive(self, client: _Client) -> bool:
        """After an interrupt: does the kernel run a trivial cell again within PROBE_SECONDS?"""
        probe = nbformat.v4.new_code_cell("pass")
        first = self.nb.cells[0]  # async_execute_cell stores the cell it ran at the index it is given
        client.timeout = int(PROBE_SECONDS)
        client.interrupt_on_timeout = False
        try:
            await client.async_execute_cell(probe, 0)
            return True
        except Exception:  # CellTimeoutError, DeadKernelError
            return False
        finally:
            client.interrupt_on_timeout = True
            self.nb.cells[0] = first

    def _label(self, i: int) -> str:
        gid = self.nb.cells[i].metadata.get("zeroedu_grade", {}).get("grade_id")
        return f"'{gid}'" if gid else "a cell you added"

    def _log_size(self) -> int:
        try:
            return (self.private / "kernel.log").stat().st_size
        except OSError:
            return 0

    def _kernel_tail(self) -> str:
        """The last line the kernel wrote to its stderr while the fatal cell ran."""
        try:
            with open(self.private / "kernel.log", "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            text = []
        last = text[-1] if text else ""
        return f"last kernel message: {last[:200]}" if last else "no message: os._exit, a crash in native code, " \
            "or the out-of-memory killer"


def _cut(text: str, limit: int) -> str:
    """text, at most `limit` characters: the start, and how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 60)
    return text[:keep] + f" [... {len(text) - keep} more characters cut by --max-output]"


class _Captured:
    """sys.stdout and sys.stderr that send a thread's writes to its buffer while it runs a test (notebooks may
    be graded in parallel threads), and everything else where it went before."""

    local = threading.local()
    _lock = threading.Lock()

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        buffer = getattr(self.local, "buffer", None)
        return (buffer or self.stream).write(text)

    def flush(self) -> None:
        buffer = getattr(self.local, "buffer", None)
        (buffer or self.stream).flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not isinstance(sys.stdout, cls):
                sys.stdout = cls(sys.stdout)
            if not isinstance(sys.stderr, cls):
                sys.stderr = cls(sys.stderr)


class _KernelLink:
    """What in_kernel and the learner proxies talk to while the grader runs one test cell (from a worker
    thread): kernel.serve runs in the kernel for the whole cell, and requests and answers go through two named
    pipes in the work folder, under what is left of the test's time."""

    def __init__(self, runner: _Runner, deadline: float) -> None:
        self.runner = runner
        self.deadline = deadline
        self.status = "ok"
        self.detail = ""
        self.folder = runner.workdir / kernel_exchange()
        self.future: Any = None
        self.requests = -1
        self.answers = -1
        self.paths: list[Path] = []

    def _start(self) -> None:
        token = os.urandom(8).hex()
        self.folder.mkdir(exist_ok=True)
        paths = [self.folder / f"{token}.{end}" for end in ("in", "out")]
        for path in paths:
            os.mkfifo(path, 0o666)
            os.chmod(path, 0o666)   # the kernel may run as another user
        assert self.runner.loop is not None
        self.future = asyncio.run_coroutine_threadsafe(self.runner.serve(token, self.deadline), self.runner.loop)
        self.answers = os.open(paths[1], os.O_RDONLY | os.O_NONBLOCK)
        while True:   # the write end opens once the kernel has opened the read end
            try:
                self.requests = os.open(paths[0], os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if self.future.done() or time.monotonic() > self.deadline:
                    self._ended()
                time.sleep(0.005)
        os.set_blocking(self.requests, True)
        self.paths = paths   # removed in close(): the kernel may not have opened the answer pipe yet

    def _ended(self) -> None:
        status, detail = self.future.result() if self.future is not None and self.future.done() else \
            ("timeout", f"{max(0.0, self.deadline - time.monotonic()):.0f}")
        self.status, self.detail = (status, detail) if status != "ok" else ("ended", "")
        if status in ("killed", "died"):
            self.runner.kernel_lost = True
        raise remote.KernelUnavailable(f"your code did not finish: {status}" if status != "ok" else
                                       "the kernel stopped answering (your code ended the grader's request loop)")

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self.answers], [], [], max(0.0, min(left, 0.5)))
            if ready:
                chunk = os.read(self.answers, min(n - len(out), 1 << 20))
                if not chunk:
                    self._wait_end()
                out += chunk
            elif left <= 0 or (self.future is not None and self.future.done()):
                self._wait_end()
        return bytes(out)

    def _wait_end(self) -> None:
        if self.future is not None:
            with contextlib.suppress(Exception):
                self.future.result(timeout=max(1.0, self.deadline - time.monotonic() + 10))
        self._ended()

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self.status != "ok" or self.runner.kernel_lost:
            raise remote.KernelUnavailable("the kernel is gone (an earlier request of this test timed out or "
                                           "ended it)")
        if self.future is None:
            self._start()
        data = pickle.dumps({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs)})
        try:
            os.write(self.requests, len(data).to_bytes(8, "big") + data)
        except OSError:
            self._wait_end()
        size = int.from_bytes(self._read(8), "big")
        if size > remote.MAX_ANSWER_BYTES:
            raise remote.KernelUnavailable(f"your code returned {size} bytes of data, more than the grader reads "
                                           f"({remote.MAX_ANSWER_BYTES})")
        return remote.decode_answer(self._read(size), self.runner.limits.max_output, self.runner.ns)

    def close(self) -> None:
        """Tell the kernel's loop this test is done, and wait for its cell to end."""
        if self.future is None:
            return
        with contextlib.suppress(OSError):
            os.write(self.requests, (0).to_bytes(8, "big"))
        for fd in (self.requests, self.answers):
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in self.paths:
            path.unlink(missing_ok=True)
        try:
            status, detail = self.future.result(timeout=max(5.0, self.deadline - time.monotonic() + 10))
        except Exception:
            status, detail = "timeout", ""
        if status != "ok" and self.status == "ok":
            self.status, self.detail = status, detail
        if status in ("killed", "died"):
            self.runner.kernel_lost = True


def kernel_exchange() -> str:
    from zeroedu.grading.kernel import EXCHANGE

    return EXCHANGE


def _test_name(cell: Any, grade_id: str) -> str:
    names = re.findall(r"\bcheck\(\s*f?[\"']([^\"']+)[\"']", cell.source)
    return "; ".join(names) if names else grade_id


_RUN_IT = ": run the cell that defines it first, and fix it if it fails"  # check.describe_exception says the same


def _plain(run: CellRun) -> str:
    """A failed test cell's outcome in plain words."""
    if run.status == "timeout":
        return (f"timed out after {run.evalue or '?'} s and was interrupted: an infinite loop, or ranks waiting for "
                "each other (a deadlock)")
    if run.status == "killed":
        return (f"ran past {run.evalue or '?'} s and ignored the interrupt: the kernel and every process it "
                "started were killed, and a fresh kernel ran the cells after it")
    if run.status == "died":
        return f"the kernel died while it ran ({run.evalue}); a fresh kernel ran the cells after it"
    if run.status == "not run":
        return f"not run: {run.evalue}" if run.evalue else "not run"
    ename, evalue = run.ename, run.evalue
    if ename in ("CheckFailed", REFUSED_ENAME):
        return evalue
    if ename == "NotImplementedError":
        return f"not implemented yet: {evalue}" if evalue else "not implemented yet"
    if ename == "NameError":
        return f"{evalue}{_RUN_IT}"
    if ename == "AssertionError":
        return evalue or "a test assertion failed"
    return f"{ename}: {evalue}"


def score(nb: Any, runs: list[CellRun]) -> tuple[list[TestResult], list[str]]:
    tests, notes = [], []
    earlier = ""
    for cell, run in zip(nb.cells, runs, strict=True):
        gid = cell.metadata.get("zeroedu_grade", {}).get("grade_id")
        info = nbtools.cell_info(cell) if gid else None
        if info is not None and info.role == "test":
            passed = run.status in ("ok", "skipped")
            message = "" if passed else _plain(run)
            if earlier and "is not defined" in message:  # say which earlier cell left the name undefined
                message = message.replace(_RUN_IT, "") + f" ({earlier})"
            tests.append(TestResult(gid, _test_name(cell, gid), info.points if passed else 0.0, info.points,
                                    passed, message, info.hidden))
        elif cell.cell_type == "code" and run.status not in ("ok", "skipped", "not run"):
            what = f"answer cell '{gid}'" if info is not None and info.role == "answer" else (
                f"given cell '{gid}'" if gid else "cell you added")
            text = f"the {what} failed: {_plain(run)}"
            if earlier and "is not defined" in text:
                text = text.replace(_RUN_IT, "") + f" ({earlier})"
            notes.append(text)
            earlier = earlier or text
    return tests, notes


def _refusals(private: Path) -> list[str]:
    """The guard's refusals, from the kernel's stderr as the grader received it (outside the sandbox)."""
    try:
        lines = (private / "kernel.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if not line.startswith(REFUSED_MARK):
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            r = json.loads(line[len(REFUSED_MARK):])
            out.append(f"refused to {str(r['op'])[:20]} {str(r['path'])[:300]}: outside the notebook's working "
                       "directory")
    return list(dict.fromkeys(out))[:20]


def full_points(solution: Any) -> float:
    """What an exercise is worth: the points of every test cell of its solution."""
    return sum(nbtools.cell_info(c).points for c in solution.cells if nbtools.cell_info(c).role == "test")


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
    """Grade one notebook (a copy the grader made: `shown_as` is the submission's own path, for the report)."""
    from zeroedu.grading import sandbox as sb

    options = options or default_options(None, [path], executed)
    t0 = time.monotonic()
    shown = shown_as or str(path)
    result = ExerciseResult(learner, path.stem, shown)
    try:
        submission = nbtools.read(path)
    except Exception as e:
        result.status = "unreadable"
        result.notes.append(f"cannot read {shown} as a notebook: {type(e).__name__}: {_cut(str(e), 300)}")
        return result
    name = match_solution(path, submission, solutions)
    if name is None:
        result.status = "unknown exercise"
        result.notes.append(f"{Path(shown).name} matches no notebook in the solutions folder (by name or by "
                            f"nbgrader grade_ids); known: {', '.join(sorted(solutions))}")
        return result
    result.exercise = name
    nb = assemble(submission, solutions[name])
    for i, why in forged_answers(nb, solutions[name]).items():
        nb.cells[i].metadata["zeroedu_grade"]["refused"] = _cut(why, limits.max_output)
    workdir = Path(tempfile.mkdtemp(prefix="nb-", dir=scratch))
    private = Path(tempfile.mkdtemp(prefix="grader-", dir=scratch))
    shutil.copyfile(path, workdir / Path(shown).name)
    blocks = solutions[name].metadata.get("zeroedu", {}).get("write_your_own", [])
    (private / "config.json").write_text(json.dumps({"blocks": blocks}), encoding="utf-8")
    box = None
    if not options.trusted:
        box = sb.Sandbox(workdir, Path(tempfile.mkdtemp(prefix="ipc-", dir=scratch)), private / "config.json",
                         options.hidden, options.sandbox_limits or sb.Limits())
    runner = _Runner(nb, workdir, private, limits, box)
    runner.run()
    result.tests, notes = score(nb, runner.runs)
    result.notes = notes + runner.notes + _refusals(private)
    if runner.truncated:
        result.notes.append(f"printed more than {limits.max_output} bytes; the rest of the output was dropped")
    result.notes += shadowed_engine_names(nb, submission)
    result.points = sum(t.points for t in result.tests)
    result.max_points = full_points(solutions[name])
    result.seconds = round(time.monotonic() - t0, 1)
    _cap_messages(result, limits.max_output)
    if executed is not None:
        out = executed / learner / f"{name}.ipynb"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(nbtools.write_text(nb), encoding="utf-8")
    return result


def _cap_messages(result: ExerciseResult, limit: int) -> None:
    result.notes = [_cut(n, limit) for n in result.notes]
    for t in result.tests:
        t.message = _cut(t.message, limit)


def shadowed_engine_names(nb: Any, submission: Any) -> list[str]:
    """Notes for learner classes that define a name their zeroedu base class already has and the template
    did not ask for: such a helper silently replaces the engine's own."""
    asked = set(nb.metadata.get("zeroedu_grade", {}).get("answer_methods", []))
    notes = []
    for cell in submission.cells:
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                     if isinstance(b, ast.Name | ast.Attribute)]
            engine = _engine_class(bases)
            if engine is None:
                continue
            for item in node.body:
                names = ([item.name] if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) else
                         [t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)])
                for method in names:
                    if method in asked or method.startswith("__"):
                        continue
                    if hasattr(engine, method):
                        notes.append(f"your class {node.name} defines {method!r}, which {engine.__name__} already "
                                     f"has: it replaces the engine's own {method!r} (not one of the methods this "
                                     "exercise asks for). Give your helper a name of its own.")
    return notes


def _engine_class(bases: list[str]) -> type | None:
    import zeroedu.stages as stages

    for base in bases:
        cls = getattr(stages, base, None)
        if isinstance(cls, type):
            return cls
    return None


# -- which notebooks, whose ------------------------------------------------------------------------------

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


def grade(paths: list[Path], solutions_dir: Path, limits: Limits, executed: Path | None = None,
          progress: bool = True, options: Options | None = None, jobs: int = 1) -> list[ExerciseResult]:
    solutions = load_solutions(solutions_dir)
    options = options or default_options(solutions_dir, paths, executed)
    pairs = collect(paths)
    results: list[ExerciseResult] = []
    with tempfile.TemporaryDirectory(prefix="zeroedu-grade-") as scratch:
        subs, dropped = newest_only(stage(pairs, solutions, Path(scratch) / "submissions"))

        def one(sub: Submission) -> ExerciseResult:
            if sub.problem or sub.copy is None:
                r = ExerciseResult(sub.learner, sub.exercise or sub.path.stem, str(sub.path), "refused")
                r.notes.append(_cut(sub.problem, limits.max_output))
            else:
                if progress:
                    print(f"grading {sub.learner}: {sub.path}", file=sys.stderr, flush=True)
                r = grade_notebook(sub.copy, sub.learner, solutions, limits, Path(scratch), executed, options,
                                   shown_as=str(sub.path))
                r.sha256 = sub.sha256
            if r.status != "graded" and sub.exercise in solutions:
                r.exercise = sub.exercise
                r.max_points = full_points(solutions[sub.exercise])   # 0 of the full points, not 0 of 0
            for old in dropped.get(id(sub), []):
                r.notes.append(f"also handed in: {old.path} (older than {sub.path}; only the newest is graded)")
            return r

        if jobs > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                results = list(pool.map(one, subs))
        else:
            results = [one(sub) for sub in subs]
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
    return results


# -- reports ---------------------------------------------------------------------------------------------

def _num(x: float) -> str:
    return f"{x:g}"


def table(results: list[ExerciseResult], width: int = 70) -> str:
    rows = [("learner", "exercise", "points", "tests", "first failure")]
    for r in results:
        failure = r.first_failure.replace("\n", " ")
        rows.append((r.learner, r.exercise, f"{_num(r.points)}/{_num(r.max_points)}",
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
        lines += [f"{learner}: {_num(p)}/{_num(m)}" for learner, (p, m) in totals.items()]
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
                        "status": r.status, "first_failure": r.first_failure, "notes": " | ".join(r.notes)})


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
    parser.add_argument("--max-processes", type=int, default=1024,
                        help="processes and threads in the sandboxes (default 1024)")
    parser.add_argument("--jobs", type=int, default=2, help="notebooks graded at once (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
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
        outputs = [p for p in (args.json, args.csv, args.executed) if p is not None]
        options.hidden = sb.hidden_paths(solutions_dir, list(args.paths), outputs)
        options.sandbox_limits = sb.Limits(memory=int(args.memory_gb * 2**30), processes=args.max_processes,
                                           cpu_seconds=int(2 * args.notebook_timeout + 600))
    limits = Limits(args.timeout, args.notebook_timeout, args.max_output)
    try:
        results = grade(args.paths, args.solutions or default_dir("solutions"), limits, args.executed,
                        progress=not args.quiet, options=options, jobs=args.jobs)
    except FileNotFoundError as e:
        print(f"zeroedu grade: {e}", file=sys.stderr)
        return 2
    if not results:
        print("zeroedu grade: no notebooks found in " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(gradebook(results), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.csv:
        write_csv(results, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
