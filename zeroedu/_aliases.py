"""Old module paths of zeroedu, kept importable after the modules moved into packages (December 2026).

Notebooks, exercises, learners' submissions and saved checkpoints name modules by the paths they had when
zeroedu was one flat folder: `zeroedu.stages.stage2`, `zeroedu.viz`, `zeroedu.checkpointing`... Each old path is
one line of OLD_TO_NEW below. A finder at the front of `sys.meta_path` answers an import of an old path (or of
anything under it, `zeroedu.stages.stage2` under `zeroedu.stages`) with the module at the new path: the very same
module object, so a class, a monkeypatch or an isinstance check is the same whichever path imported it, and no
module is ever loaded twice. `zeroedu.__getattr__` uses the same table for `zeroedu.viz` and `from zeroedu
import viz`. There are no stub files: the table is the whole mechanism.

New code imports the new paths; this table says where each module went.

`zeroedu.launch` is both a package (zeroedu/launch/) and the function every notebook calls,
`zeroedu.launch(train, world_size=4)`. `callable_module` makes the package callable, so the name means one object
whatever was imported first (`import zeroedu.launch.rank` binds the package, never the function, to
`zeroedu.launch`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

OLD_TO_NEW = {
    "zeroedu.launch_rank": "zeroedu.launch.rank",
    "zeroedu.launch_status": "zeroedu.launch.status",
    "zeroedu.launch_diagnose": "zeroedu.launch.diagnose",
    "zeroedu.launch_rundir": "zeroedu.launch.rundir",
    "zeroedu.checkpoint_files": "zeroedu.checkpoint.files",
    "zeroedu.checkpoint_format": "zeroedu.checkpoint.fileformat",
    "zeroedu.checkpoint_state": "zeroedu.checkpoint.state",
    "zeroedu.checkpointing": "zeroedu.activation_checkpointing",
    "zeroedu.comm_thread": "zeroedu.comm.thread",
    "zeroedu.collectives": "zeroedu.comm.collectives",
    "zeroedu.ledger": "zeroedu.comm.ledger",
    "zeroedu.flat": "zeroedu.engine.flat",
    "zeroedu.report": "zeroedu.engine.report",
    "zeroedu.stages": "zeroedu.engine.stages",
    "zeroedu.offload": "zeroedu.engine.extras.offload",
    "zeroedu.zeropp": "zeroedu.engine.extras.zeropp",
    "zeroedu.planner": "zeroedu.theory.planner",
    "zeroedu.vocab": "zeroedu.theory.vocab",
    "zeroedu.links": "zeroedu.theory.links",
    "zeroedu.viz": "zeroedu.course.viz",
    "zeroedu.widgets": "zeroedu.course.widgets",
    "zeroedu.tour": "zeroedu.course.tour",
    "zeroedu.graduate": "zeroedu.course.graduate",
    "zeroedu.course_big": "zeroedu.course.big_models",
    # the per-exercise harnesses that know the engine, now beside the sandboxed grader rather than inside it
    "zeroedu.grading.engines": "zeroedu.grading.exercises.engines",
    "zeroedu.grading.ring": "zeroedu.grading.exercises.ring",
    "zeroedu.grading.training": "zeroedu.grading.exercises.training",
    "zeroedu.grading.memory": "zeroedu.grading.exercises.memory",
    "zeroedu.grading.stage1_sharding": "zeroedu.grading.exercises.stage1_sharding",
    "zeroedu.grading.stage2_accumulation": "zeroedu.grading.exercises.stage2_accumulation",
    "zeroedu.grading.stage3_gather": "zeroedu.grading.exercises.stage3_gather",
    "zeroedu.grading.offload_step": "zeroedu.grading.exercises.offload_step",
    "zeroedu.grading.qwz_quantize": "zeroedu.grading.exercises.qwz_quantize",
    "zeroedu.grading.ddp_buckets": "zeroedu.grading.exercises.ddp_buckets",
    "zeroedu.grading.learner_code": "zeroedu.grading.exercises.learner_code",
    "zeroedu.grading.ranks": "zeroedu.grading.exercises.ranks",
}


def new_name(name: str) -> str | None:
    """The module path that `name` (an old path, or a module under one) has now; None if it did not move."""
    for old, new in OLD_TO_NEW.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _SameModule(importlib.abc.Loader):
    """Loads an old path by importing the new one and handing back that module object itself."""

    def __init__(self, target: str):
        self.target = target
        self.spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the old path's spec on the module between create and exec; the module keeps
        # its own (its name, file and loader), so reloading it or pickling by its name still uses the real path.
        module.__spec__ = self.spec


class OldPaths(importlib.abc.MetaPathFinder):
    """Answers imports of the old paths in OLD_TO_NEW. It sits first in sys.meta_path: otherwise the path finder
    would find zeroedu/engine/stages/stage2.py again through the aliased parent's __path__ and load a second copy
    under the old name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("zeroedu.") else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _SameModule(new))


def install() -> None:
    """Put the finder first in sys.meta_path, once per interpreter."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())


class _CallableModule(types.ModuleType):
    """A module that is also called: zeroedu.launch(...) runs zeroedu.launch.launch(...)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["__call_target__"](*args, **kwargs)

    def __reduce__(self) -> tuple:
        # Pickled by name like any module (cloudpickle looks modules up by their exact type, which this is not).
        return importlib.import_module, (self.__name__,)


def callable_module(name: str, target: Callable) -> None:
    """Make module `name` callable: calling it calls `target`."""
    module = sys.modules[name]
    module.__call_target__ = target  # type: ignore[attr-defined]
    module.__class__ = _CallableModule
