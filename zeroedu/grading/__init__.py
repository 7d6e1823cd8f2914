"""Graded exercises: solutions/ is the source of truth, exercises/ is generated, `zeroedu grade` scores them.

In a notebook:

    from zeroedu.grading import check
    check("stage 3 divides everything by N", 2, lambda: ...)       # "✓ name (2/2)" or "✗ name (0/2): hint"

Modules: check (the check-cell helper), notebook (nbgrader cell conventions, stubs), build
(`zeroedu build-exercises`), grader (`zeroedu grade`), ranks (running learner code on real ranks in a test),
ring (the harness of the ring-collectives exercise), training (a learner's piece of the engine trained on ranks
against one process), engines (where exercises 3-8 plug into the engine, and their own checks), guard (the
grader's file-system audit hook).
"""

from zeroedu.grading.check import CheckFailed, check, describe_exception

__all__ = ["CheckFailed", "check", "describe_exception"]
