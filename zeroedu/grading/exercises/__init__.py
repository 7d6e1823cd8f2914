"""The per-exercise harnesses: the part of the grader that knows the engine.

One module per exercise with its own checks (memory for exercise 1, ring for 2, ddp_buckets, stage1_sharding,
stage2_accumulation, stage3_gather, offload_step and qwz_quantize for 3-8, re-exported together by engines), and
what they share: training (a learner's piece of the engine trained on ranks against one process), ranks
(running learner code on real ranks in a test) and learner_code. They run where the sandboxed grader
(zeroedu.grading: runner, sandbox, kernel, score, ...) puts them: checks in the grader's process, the marked
parts (in_kernel) next to the learner's code.

Each module is also importable under its old name, zeroedu.grading.<module> (notebooks import those).
"""
