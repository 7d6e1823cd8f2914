"""Graded exercises: solutions/ is the source of truth, exercises/ is generated, `zeroedu grade` scores them.

In a notebook:

    from zeroedu.grading import check
    check("stage 3 divides everything by N", 2, lambda: ...)       # "✓ name (2/2)" or "✗ name (0/2): hint"

Two parts. The sandboxed grader, which knows notebooks and sandboxes but not the engine: check (the check-cell
helper), notebook (nbgrader cell conventions, stubs), build (`zeroedu build-exercises`), grader (`zeroedu grade`;
its steps in submissions, assembly, source, runner, client, link, score, results and report), sandbox
(bubblewrap), kernel and remote (the two ends of a test's requests), scratch (clean-up), guard (the file-system
audit hook). And exercises/, the per-exercise harnesses that know the engine: ranks, ring, training, memory,
engines (re-exports ddp_buckets, stage1_sharding, stage2_accumulation, stage3_gather, offload_step and
qwz_quantize) and learner_code; each is importable under its old name too (zeroedu.grading.training, ...).
ex10 (exercise 10's harness) stays here for now.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from zeroedu.grading.check import CheckFailed, check, describe_exception

__all__ = ["CheckFailed", "check", "describe_exception"]

_MOVED = frozenset({"engines", "ring", "training", "memory", "stage1_sharding", "stage2_accumulation",
                    "stage3_gather", "offload_step", "qwz_quantize", "ddp_buckets", "learner_code", "ranks"})


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import zeroedu.grading.training` (what notebooks say) gives the module zeroedu.grading.exercises.training
    itself, one module under two names, imported only when asked for."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        parent, _, leaf = name.rpartition(".")
        if parent == __name__ and leaf in _MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    real_specs: dict[str, importlib.machinery.ModuleSpec] = {}   # old name -> the module's own spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        module = importlib.import_module(f"{__name__}.exercises.{spec.name.rpartition('.')[2]}")
        self.real_specs.setdefault(spec.name, module.__spec__)
        return module

    def exec_module(self, module: object) -> None:
        # The import system set the old name's spec on the module; give it back its own.
        module.__spec__ = self.real_specs[module.__spec__.name]  # type: ignore[attr-defined]


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.insert(0, _OldNames())
