"""Graded exercises: solutions/ is the source of truth, exercises/ is generated, `zeroedu grade` scores them.

In a notebook:

    from zeroedu.grading import check
    check("stage 3 divides everything by N", 2, lambda: ...)       # "✓ name (2/2)" or "✗ name (0/2): hint"

Modules: check (the check-cell helper), notebook (nbgrader cell conventions, stubs), build
(`zeroedu build-exercises`), grader (`zeroedu grade`; its steps in submissions, assembly, source, runner, client,
link, score, results and report), ranks (running learner code on real ranks in a test), ring (the harness of the
ring-collectives exercise), training (a learner's piece of the engine trained on ranks against one process),
engines (where exercises 3-8 plug into the engine: re-exports ddp_buckets, stage1_sharding, stage2_accumulation,
stage3_gather, offload_step and qwz_quantize, one module per exercise with its own checks, and learner_code, what
they share), guard (the grader's file-system audit hook).
"""

from zeroedu.grading.check import CheckFailed, check, describe_exception

__all__ = ["CheckFailed", "check", "describe_exception"]
