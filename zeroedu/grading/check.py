"""The check cell helper: run one test, print a score line, and on failure say what is wrong in plain words.

    check("memory at stage 3 divides everything by N", 2, lambda: ...)

    @check("reduce-scatter sums every rank's chunk", points=2)
    def _():
        assert ..., "hint shown to the learner"

A passing test prints "✓ name (2/2)". A failing one raises CheckFailed, which Jupyter shows as the single line
"✗ name (0/2): hint" instead of a traceback. The cell then counts as failed, exactly as nbgrader grades a test
cell (a test cell passes when it runs without an error), so the same notebooks work with nbgrader and with
`zeroedu grade`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["CheckFailed", "check", "describe_exception"]

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # all of zeroedu


class CheckFailed(AssertionError):
    """A check did not pass. str() is the hint; Jupyter renders the whole score line."""

    def __init__(self, name: str, points: float, hint: str) -> None:
        super().__init__(hint)
        self.name = name
        self.points = points
        self.hint = hint

    def line(self) -> str:
        return f"✗ {self.name} (0/{_fmt(self.points)}): {self.hint}"

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of a traceback
        return [self.line()]


def _fmt(points: float) -> str:
    return str(int(points)) if float(points).is_integer() else str(points)


def _learner_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of the learner's code: not zeroedu, not a library, not the standard library."""
    frames = traceback.extract_tb(tb)
    skip = (_OWN_DIR, "site-packages", os.path.dirname(os.__file__))
    mine = [f for f in frames if not f.filename.startswith(skip)]
    return mine[-1] if mine else None


def describe_exception(e: BaseException) -> str:
    """An exception as a hint: what was raised, and where in the learner's code."""
    from zeroedu.i18n import tr  # the learner's language (zeroedu.lang("zh") in the Chinese notebooks)

    if isinstance(e, NotImplementedError):
        return tr(f"not implemented yet: {e}", f"尚未实现：{e}") if str(e) else tr(
            "not implemented yet (it raises NotImplementedError)", "尚未实现（仍抛出 NotImplementedError）")
    if isinstance(e, AssertionError):
        return str(e) or tr("a test assertion failed (no message)", "测试断言失败（没有说明）")
    if type(e) is NameError:  # almost always a cell that did not run, or failed, before this one
        return tr(f"{e}: run the cell that defines it first, and fix it if it fails",
                  f"{e}：请先运行定义它的单元格；如果那个单元格报错，先把它修好")
    where = ""
    frame = _learner_frame(e.__traceback__)
    if frame is not None:
        code = f": {frame.line.strip()}" if frame.line else ""
        where = tr(f" in {frame.name}, line {frame.lineno} of its cell{code}",
                   f"（在 {frame.name} 中，所在单元格第 {frame.lineno} 行{code}）")
    return tr(f"your code raised {type(e).__name__}: {e}{where}", f"你的代码抛出了 {type(e).__name__}：{e}{where}")


def check(name: str, points: float = 1, test: Callable[[], Any] | None = None) -> Any:
    """Run `test()`; print "✓ name (p/p)" or raise CheckFailed with a hint.

    Without `test`, returns a decorator that runs the decorated function at once (and leaves None behind), so a
    multi-line test reads as a block. An AssertionError's message is the hint; any other exception from the
    learner's code becomes "your code raised ..." with the line it came from.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check(name, points, test): name must be a non-empty string, got {name!r}")
    if isinstance(points, bool) or not isinstance(points, int | float) or points < 0:
        raise TypeError(f"check({name!r}, points, test): points must be a number >= 0, got {points!r}")
    if test is None:
        def run(fn: Callable[[], Any]) -> None:
            check(name, points, fn)
        return run
    try:
        test()
    except Exception as e:  # KeyboardInterrupt and SystemExit pass: the grader's timeouts must stop the cell
        raise CheckFailed(name, points, describe_exception(e)) from None
    sys.stdout.write(f"✓ {name} ({_fmt(points)}/{_fmt(points)})\n")  # one write: one output in the notebook
    return None
