"""What every engine exercise's adapter asks of the learner's code (exercises 3-8).

`not_your_own`: is a class the learner's own, writing the asked methods in its body (not zeroedu's class under
another name, nor a method inherited or assigned from it); `first_stub`: the first of its methods still raising
NotImplementedError; `_learner_or`: the learner's class for the cases of the learner, the engine's own for the
others (the stage exercises 4-6); `_itemsize`: bytes per element of a dtype named in a rank's report.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zeroedu.engine.stages import Stage1, Stage2, Stage3
from zeroedu.grading.exercises.ranks import not_implemented
from zeroedu.grading.exercises.training import Case
from zeroedu.i18n import tr


def not_your_own(cls: Any, names: Any) -> str | None:
    """Why `cls` is not a class of the learner's that writes `names` itself, or None: zeroedu's own class under
    another name (`MyStage1 = Stage1`), or a class whose method comes from zeroedu (inherited, or assigned from
    the engine's class)."""
    from zeroedu.grading.kernel import _is_learner_class, is_library_code

    if not isinstance(cls, type):
        return tr(f"{cls!r} is not a class: write the class the template asks for",
                  f"{cls!r} 不是一个类：请按模板的要求写出这个类")
    if not _is_learner_class(cls):
        return tr(f"{cls.__name__} is zeroedu's own class, not one you wrote (or passes itself off as one): define "
                  f"`class {cls.__name__}(...)` in the answer cell and write its methods in its body",
                  f"{cls.__name__} 是 zeroedu 自己的类（或冒充成它），不是你写的：请在答题单元格里定义 "
                  f"`class {cls.__name__}(...)`，并在类体里写出它的方法")
    for name in names:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if name.startswith("__") or owner is None:   # no such method: first_stub says so
            continue
        fn = vars(owner)[name]
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if not _is_learner_class(owner) or code is None or is_library_code(code):
            return tr(f"{cls.__name__}.{name} is zeroedu's own code (inherited from {owner.__name__}, or assigned "
                      f"from it), not yours: write {name} in your class's body",
                      f"{cls.__name__}.{name} 是 zeroedu 自己的代码（继承自 {owner.__name__}，或从它赋值而来），"
                      f"不是你写的：请在你的类体里写出 {name}")
    return None


def first_stub(cls: type, methods: dict[str, tuple]) -> str | None:
    """The NotImplementedError message of the first method of cls that is still a stub, called on a bare
    instance with the given arguments (real code fails otherwise, or needs ranks: it is not a stub); or why
    cls is not the learner's own class with those methods (not_your_own)."""
    problem = not_your_own(cls, methods)
    if problem is not None:
        return problem
    bare = object.__new__(cls)
    for name, args in methods.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return tr(f"{cls.__name__} has no method {name}: keep the method names of the template",
                      f"{cls.__name__} 没有方法 {name}：请保留模板里的方法名")
        message = not_implemented(fn, bare, *args)
        if message is not None:
            return message
    return None


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _learner_or(stage_cls: type, learner_cls: type, wrap: type | None = None) -> Callable[[Case], type]:
    """The learner's class (under `wrap`, if given) for cases of the learner, the engine's own otherwise."""
    return functools.partial(_pick_class, stage_cls, learner_cls, wrap)


# The methods each stage exercise asks for: in a rank, the learner's class must define them itself.
_ASKED = {Stage1: ("reduce_bucket", "optimizer_step", "publish"), Stage2: ("reduce_bucket",),
          Stage3: ("fetch", "release")}


def _pick_class(stage_cls: type, learner_cls: type, wrap: type | None, case: Case) -> type:
    cls = learner_cls if case.engine == "yours" else stage_cls
    if case.engine == "yours":
        problem = not_your_own(learner_cls, _ASKED.get(stage_cls, ()))
        if problem is not None:
            raise AssertionError(problem)
    return type(cls.__name__, (wrap, cls), {}) if wrap is not None else cls
