"""Graded exercises: solutions/ is the source of truth, exercises/ is generated, `zeroedu grade` scores them.

In a notebook:

    from zeroedu.grading import check, tr
    check("stage 3 divides everything by N", 2, lambda: ...)       # "✓ name (2/2)" or "✗ name (0/2): hint"
    check(tr("stage 3 divides everything by N", "ZeRO-3 把一切都除以 N"), 2, ...)   # in the learner's language

Two parts. The sandboxed grader, which knows notebooks and sandboxes but not the engine: check (the check-cell
helper), notebook (nbgrader cell conventions, stubs), build (`zeroedu build-exercises`), grader (`zeroedu grade`;
its steps in submissions, assembly, source, runner, client, link, score, results and report), sandbox
(bubblewrap), kernel and remote (the two ends of a test's requests), scratch (clean-up), guard (the file-system
audit hook). And exercises/, the per-exercise harnesses that know the engine: ranks, ring, training, memory,
engines (re-exports ddp_buckets, stage1_sharding, stage2_accumulation, stage3_gather, offload_step and
qwz_quantize) and learner_code; each is importable under its old name too (zeroedu.grading.training, ...;
zeroedu._aliases holds the table).
ex10 (exercise 10's harness) stays here for now.
"""

from zeroedu.grading.check import CheckFailed, check, describe_exception
from zeroedu.i18n import tr  # the exercises' test cells say their checks' names and hints in the learner's language

__all__ = ["CheckFailed", "check", "describe_exception", "tr"]
