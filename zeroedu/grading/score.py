"""A graded notebook's verdicts: each test cell's points and message from how its cell ran (score), notes for
the other cells that failed, the guard's refusals from the kernel's log, and what an exercise is worth."""

from __future__ import annotations

import ast
import contextlib
import json
import re
from pathlib import Path
from typing import Any

from zeroedu.grading import notebook as nbtools
from zeroedu.grading.results import CellRun, TestResult
from zeroedu.grading.runner import REFUSED_ENAME
from zeroedu.i18n import tr

REFUSED_MARK = "zeroedu-grade-refused "   # guard/sitecustomize.py writes refusals after it


def _test_name(cell: Any, grade_id: str) -> str:
    """The names the cell's check() calls give, read from its source: a plain string, or tr("English", "中文") said
    in the grader's language; the grade_id when there is none."""
    names = []
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:   # a magic, say: the names written as plain strings
        names = re.findall(r"\bcheck\(\s*[\"']([^\"']+)[\"']", cell.source)
        return "; ".join(names) if names else grade_id
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check"
                and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Call) and isinstance(first.func, ast.Name) and first.func.id == "tr":
            texts = [a.value for a in first.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if len(texts) == 2:
                names.append(tr(*texts))
        elif isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.append(first.value)
    return "; ".join(names) if names else grade_id


def _run_it() -> str:   # check.describe_exception says the same
    return tr(": run the cell that defines it first, and fix it if it fails",
              "：请先运行定义它的单元格；如果那个单元格报错，先把它修好")


def _plain(run: CellRun) -> str:
    """A failed test cell's outcome in plain words (in the language being graded: i18n.speaking)."""
    limit = run.evalue or "?"
    if run.status == "timeout":
        return tr(f"timed out after {limit} s and was interrupted: an infinite loop, or ranks waiting for each "
                  "other (a deadlock)",
                  f"运行超过 {limit} 秒被中断：可能是死循环，或各 rank 互相等待（deadlock，死锁）")
    if run.status == "killed":
        return tr(f"ran past {limit} s and ignored the interrupt: the kernel and every process it started were "
                  "killed, and a fresh kernel ran the cells after it",
                  f"运行超过 {limit} 秒且不响应中断：kernel 及其启动的所有进程都被终止，"
                  "之后的单元格在新的 kernel 中运行")
    if run.status == "died":
        return tr(f"the kernel died while it ran ({run.evalue}); a fresh kernel ran the cells after it",
                  f"运行时 kernel 崩溃了（{run.evalue}）；之后的单元格在新的 kernel 中运行")
    if run.status == "not run":
        return tr(f"not run: {run.evalue}", f"没有运行：{run.evalue}") if run.evalue else tr("not run", "没有运行")
    ename, evalue = run.ename, run.evalue
    if ename in ("CheckFailed", REFUSED_ENAME):
        return evalue
    if ename == "NotImplementedError":
        return tr(f"not implemented yet: {evalue}", f"尚未实现：{evalue}") if evalue else tr(
            "not implemented yet", "尚未实现")
    if ename == "NameError":
        return f"{evalue}{_run_it()}"
    if ename == "AssertionError":
        return evalue or tr("a test assertion failed", "测试断言失败")
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
                message = message.replace(_run_it(), "") + f" ({earlier})"
            tests.append(TestResult(gid, _test_name(cell, gid), info.points if passed else 0.0, info.points,
                                    passed, message, info.hidden))
        elif cell.cell_type == "code" and run.status not in ("ok", "skipped", "not run"):
            if info is not None and info.role == "answer":
                what = tr(f"answer cell '{gid}'", f"答案单元格 '{gid}'")
            elif gid:
                what = tr(f"given cell '{gid}'", f"给定的单元格 '{gid}'")
            else:
                what = tr("cell you added", "你添加的单元格")
            text = tr(f"the {what} failed: {_plain(run)}", f"{what}出错：{_plain(run)}")
            if earlier and "is not defined" in text:
                text = text.replace(_run_it(), "") + f" ({earlier})"
            notes.append(text)
            earlier = earlier or text
    return tests, notes


# The guard that refuses writes runs inside the learner's process, and its log shares the kernel's stderr: the
# notebook's own code can write the same line (a secret in that process would be readable by that code too). So
# the grader never states a refusal as its own finding: each note says where it came from. In the sandbox the
# operating system refuses those writes whatever the log says.
def from_notebook() -> str:
    return tr("reported by the notebook's own process (its code can write this line too): ",
              "由 notebook 自己的进程报告（它的代码也能写出这一行）：")


def _refusals(private: Path) -> list[str]:
    """The guard's refusals, from the kernel's stderr as the grader received it (outside the sandbox), each
    labelled as the notebook's report (from_notebook())."""
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
            op, path = str(r["op"])[:20], str(r["path"])[:300]
            out.append(from_notebook() + tr(f"refused to {op} {path}: outside the notebook's working directory",
                                            f"拒绝 {op} {path}：它在 notebook 的工作目录之外"))
    return list(dict.fromkeys(out))[:20]


def full_points(solution: Any) -> float:
    """What an exercise is worth: the points of every test cell of its solution."""
    return sum(nbtools.cell_info(c).points for c in solution.cells if nbtools.cell_info(c).role == "test")
