"""The grader side of a graded notebook's kernel: learner objects as proxies, values as plain data.

While `zeroedu grade` runs a test cell (in its own process, never in the learner's kernel), every name the
test uses that the grader does not define is a `Learner` proxy: calling it asks the kernel to call the
learner's object of that name, and what comes back is plain data, loaded with `torch.load(weights_only=True)`.
Harness functions mark the part that must run next to the learner's code with `in_kernel(fn, *args)`: in a
learner's own notebook that is just `fn(*args)`; under the grader, the kernel runs it and only its plain-data
result crosses back. Checks then run here, on those values, against references computed here.
"""

from __future__ import annotations

import builtins
import collections
import threading
from collections.abc import Callable
from typing import Any

from zeroedu.i18n import tr

MAX_ANSWER_BYTES = 512 * 2**20   # an answer file larger than this is refused, unread
MAX_ANSWER_ITEMS = 1_000_000     # values (list items, dict entries, tensors...) an answer may unfold into

_local = threading.local()


class LearnerError(Exception):
    """The learner's code raised an exception that is not one of Python's own."""


class KernelUnavailable(AssertionError):
    """The kernel did not answer (it timed out, died, or wrote nothing readable)."""


def session() -> Any:
    """The kernel link of the test cell being run by the grader in this thread, or None (not grading)."""
    return getattr(_local, "session", None)


def set_session(s: Any) -> None:
    _local.session = s


def in_kernel(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) where the learner's code lives: here, unless the grader is running this test."""
    s = session()
    if s is None:
        return fn(*args, **kwargs)
    return s.call(fn, args, kwargs)


def wire_problem(claimed: int, what: str, source: str) -> str | None:
    """After an in_kernel call that ran ranks: the reason to score 0 when they claim more bytes sent than crossed
    the sandbox's wire during that call (zeroedu.grading.wire), else None; None too outside the grader, or where
    the wire is not counted (--trusted)."""
    s = session()
    if s is None:
        return None
    from zeroedu.grading.wire import claim_problem

    return claim_problem(claimed, getattr(s, "wire", None), what, source)


class Learner:
    """A learner's object in the kernel, by name. Calls go to the kernel; it pickles as "look it up there"."""

    def __init__(self, path: str) -> None:
        self.__path = path

    @property
    def __name__(self) -> str:  # noqa: PLW3201 -- what harnesses print as the learner's function name
        return self.__path.rsplit(".", 1)[-1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        s = session()
        if s is None:
            raise RuntimeError(f"{self.__path} lives in a graded notebook's kernel; no test is running")
        return s.call(self.__path, args, kwargs)

    def __getattr__(self, attr: str) -> Learner:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Learner(f"{self.__path}.{attr}")

    def __reduce__(self) -> tuple:
        from zeroedu.grading import kernel

        return kernel.user, (self.__path,)

    def __repr__(self) -> str:
        return f"<your {self.__path}>"


class Namespace(dict):
    """A test cell's globals: what the grader's cells define, builtins, and otherwise the learner's names.

    `own`: names that the grader's cells assign; while one is unset (its cell failed) it is a NameError here,
    not a question for the kernel."""

    def __init__(self, own: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(__name__="__graded__", __builtins__=builtins)
        self.own = set(own)

    def __missing__(self, name: str) -> Any:
        if hasattr(builtins, name):
            return getattr(builtins, name)
        if name.startswith("__") or name in self.own:
            raise KeyError(name)
        return Learner(name)


class Object:
    """Something the learner returned that is not plain data: only its type name crossed over."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        self.__name__ = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name} object>"


class _Budget:
    """How many more values an answer may unfold into. A pickle can share one list many times over (a few KB
    that stand for 2**40 items): walking it must stop, not take the grader's memory and hours."""

    def __init__(self, items: int = MAX_ANSWER_ITEMS) -> None:
        self.left = items

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise KernelUnavailable(tr(f"your code returned more than {MAX_ANSWER_ITEMS} values (lists sharing "
                                       "lists count once per place they appear); the grader stopped reading it",
                                       f"你的代码返回了超过 {MAX_ANSWER_ITEMS} 个值（共享的列表在每处出现都计一次）；"
                                       "评分器停止读取"))


def unplain(x: Any, ns: dict | None = None, budget: _Budget | None = None, depth: int = 0) -> Any:
    """The kernel's plain data back as the objects a test expects (named tuples by their name in `ns`)."""
    budget = budget or _Budget()
    budget.take()
    if depth > 100:
        raise KernelUnavailable(tr("your code returned data nested more than 100 levels deep",
                                   "你的代码返回的数据嵌套超过了 100 层"))
    if isinstance(x, dict):
        if set(x) == {"__object__"}:
            return Object(str(x["__object__"])[:200])
        if set(x) == {"__namedtuple__", "fields", "values"}:
            name, fields = str(x["__namedtuple__"]), [str(f) for f in x["fields"]]
            values = [unplain(v, ns, budget, depth + 1) for v in x["values"]]
            cls = (ns or {}).get(name) if ns is not None and name in ns else None
            if not (isinstance(cls, type) and issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
                cls = collections.namedtuple(name, fields)  # type: ignore[misc]
            return cls(*values)
        return {k: unplain(v, ns, budget, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [unplain(v, ns, budget, depth + 1) for v in x]
    if isinstance(x, tuple):
        return tuple(unplain(v, ns, budget, depth + 1) for v in x)
    return x


def _check_archive(data: bytes) -> None:
    """torch.save writes an uncompressed zip; torch.load would inflate a compressed one whatever its size. Only
    stored (uncompressed) members, adding up to no more than the bytes received, are loaded."""
    import io
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise KernelUnavailable("the kernel's answer is not an archive torch.save writes") from None
    if len(members) > 100_000 or any(m.compress_type != zipfile.ZIP_STORED for m in members) or \
            sum(m.file_size for m in members) > len(data):
        raise KernelUnavailable("the kernel's answer is a compressed or inflated archive; torch.save never "
                                "writes one, so the grader does not read it")


def raise_remote(error: dict, cap: int) -> None:
    """Re-raise the learner's exception here: Python's own types as themselves, others as LearnerError."""
    error = {k: v if isinstance(v, str | bool) else "?" for k, v in error.items()}   # never str() of a structure
    name = str(error.get("type", "Exception"))[:100]
    message = str(error.get("message", ""))[:cap]
    cls = getattr(builtins, name, None) if error.get("builtin") else None
    usable = isinstance(cls, type) and issubclass(cls, Exception)
    if not usable:
        if name == "KeyboardInterrupt":
            raise KernelUnavailable(tr("your code was interrupted: it ran past the time limit of the test",
                                       "你的代码被中断了：它超过了这个测试的时间上限"))
        cls, message = LearnerError, f"{name}: {message}"
    try:
        e = cls(message)
    except Exception:  # an exception type whose constructor wants other arguments
        e = LearnerError(f"{name}: {message}")
    e.learner_where = str(error.get("where", ""))[:cap]  # type: ignore[attr-defined]
    raise e


def decode_answer(data: bytes, cap: int, ns: dict | None) -> Any:
    """The kernel's answer: its value, or the learner's exception raised here."""
    import io

    import torch

    _check_archive(data)
    try:
        answer = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise KernelUnavailable(f"the kernel's answer could not be read as plain data ({type(e).__name__})") from None
    if not isinstance(answer, dict) or not ({"value"} == set(answer) or {"error"} == set(answer)):
        raise KernelUnavailable("the kernel's answer is not in the grader's format")
    if "error" in answer:
        error = answer["error"] if isinstance(answer["error"], dict) else {"type": "Exception", "message": "?"}
        raise_remote(error, cap)
    return unplain(answer["value"], ns)
