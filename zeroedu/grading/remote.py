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

MAX_ANSWER_BYTES = 512 * 2**20   # an answer file larger than this is refused, unread

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


def unplain(x: Any, ns: dict | None = None) -> Any:
    """The kernel's plain data back as the objects a test expects (named tuples by their name in `ns`)."""
    if isinstance(x, dict):
        if set(x) == {"__object__"}:
            return Object(str(x["__object__"]))
        if set(x) == {"__namedtuple__", "fields", "values"}:
            name, fields = str(x["__namedtuple__"]), [str(f) for f in x["fields"]]
            values = [unplain(v, ns) for v in x["values"]]
            cls = (ns or {}).get(name) if ns is not None and name in ns else None
            if not (isinstance(cls, type) and issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
                cls = collections.namedtuple(name, fields)  # type: ignore[misc]
            return cls(*values)
        return {k: unplain(v, ns) for k, v in x.items()}
    if isinstance(x, list):
        return [unplain(v, ns) for v in x]
    if isinstance(x, tuple):
        return tuple(unplain(v, ns) for v in x)
    return x


def raise_remote(error: dict, cap: int) -> None:
    """Re-raise the learner's exception here: Python's own types as themselves, others as LearnerError."""
    name = str(error.get("type", "Exception"))[:100]
    message = str(error.get("message", ""))[:cap]
    cls = getattr(builtins, name, None) if error.get("builtin") else None
    usable = isinstance(cls, type) and issubclass(cls, Exception)
    if not usable:
        if name == "KeyboardInterrupt":
            raise KernelUnavailable("your code was interrupted: it ran past the time limit of the test")
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
