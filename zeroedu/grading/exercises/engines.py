"""Where each engine exercise's answer goes into the real engine: the names the notebooks of exercises 3-8 import.

The learner writes either a subclass of a stage that overrides the method the stage file defines (exercises 4,
5 and 6: `reduce_bucket`, `optimizer_step`, `publish`, `fetch`, `release`), or a function or small class with a
documented signature (exercises 3, 7 and 8), which an adapter calls at the place where the engine calls its
own. Either way the real engine trains with it, on real gloo ranks (zeroedu.grading.exercises.training).

Each adapter also counts the calls of the learner's code, and the checks insist on them: if the engine stopped
calling the place an adapter plugs into, the solution notebooks would fail their tests instead of passing with
the engine's own code.

The code lives in one module per exercise, named like its notebook: ddp_buckets (3), stage1_sharding (4),
stage2_accumulation (5), stage3_gather (6), offload_step (7), qwz_quantize (8), and learner_code for what they
share. This module only re-exports them: the notebooks' set-up cells and `grader_setup` import it.
"""

from __future__ import annotations

from zeroedu.grading.exercises.ddp_buckets import run_bucket_hooks
from zeroedu.grading.exercises.learner_code import first_stub, not_your_own
from zeroedu.grading.exercises.offload_step import run_offload
from zeroedu.grading.exercises.qwz_quantize import (
    check_block_scales,
    check_last_block,
    check_roundtrip,
    check_zero_blocks,
    run_qwz,
)
from zeroedu.grading.exercises.stage1_sharding import run_stage1
from zeroedu.grading.exercises.stage2_accumulation import check_traffic_prediction, run_stage2
from zeroedu.grading.exercises.stage3_gather import run_stage3
from zeroedu.grading.exercises.training import Case

__all__ = ["Case", "first_stub", "not_your_own", "run_bucket_hooks", "run_offload", "run_qwz", "run_stage1",
           "run_stage2", "run_stage3",
           # the checks that exercises 5 and 8 import from here too
           "check_block_scales", "check_last_block", "check_roundtrip", "check_traffic_prediction",
           "check_zero_blocks"]
