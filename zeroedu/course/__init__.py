"""The notebooks' harness: run a config on N ranks, bring results back, line measured up with theory.

A notebook cell should show the idea (a config, a formula, a comparison) and not the plumbing around it. The
plumbing lives here, once, and is tested (tests/test_course.py). One module per part of the course:
zeroedu.course.basics (notebooks 00-07), .offload (05-10), .interview (13, 15), .choosing (13), and the three
ways of seeing a step: .holdings (who holds what, when), .traces (torch profiler's Chrome trace) and
.memory_timeline (torch's memory snapshot); every name is also here:

    from zeroedu import course
    cfg = course.ds_config(stage=1, precision="bf16")              # a DeepSpeed-style config
    runs = zeroedu.launch(course.train, world_size=4, backend="gloo", args=(cfg,))
    runs[0]["per_step"], runs[0]["memory"], runs[0]["losses"]      # what every rank returned
    ref_losses, ref_state = course.reference(steps=4)               # one process, the global batch
    course.show(f"Stage 1 sends **{ratio:.2f}x** the bytes of stage 0.")   # prose rendered from a value

Every training here is the same as the tests' and the exercises': TinyGPT (or the config given), the
deterministic batches of zeroedu.models, the global batch split over the ranks (and micro-steps), and the
printed loss is the mean over the global batch. The numbers a rank returns are plain Python (picklable).
"""

from __future__ import annotations

from zeroedu.course.basics import (
    DEEPSPEED_BUCKETS,
    GB,
    GLOBAL_BATCH,
    LR,
    STEPS,
    bucket_stats,
    compare_rows,
    ds_config,
    engine_summary,
    local_engine,
    markdown_table,
    max_rel_diff,
    min_time,
    model_states,
    one_step,
    per_rank,
    reference,
    rel_weight_diff,
    run_many,
    show,
    show_source,
    stage3_units,
    train,
)
from zeroedu.course.choosing import (
    RING_SWEEP,
    calibrate_link,
    clock_and_ledger,
    ledger_of_one_step,
    slowest_rank_samples,
    time_ring_collectives,
)
from zeroedu.course.holdings import (
    AFTER_GATHER,
    AFTER_REDUCE,
    AFTER_STEP,
    END,
    Frame,
    Holding,
    Holdings,
    Stepper,
    holdings_run,
)
from zeroedu.course.holdings import figure as holdings_figure
from zeroedu.course.holdings import rows as holding_rows
from zeroedu.course.holdings import strip as holdings_strip
from zeroedu.course.interview import (
    BYTES_FORMULA,
    GRADES,
    SHARDED,
    Verdict,
    Verdicts,
    cheat_sheet_rows,
    cpu_adam_rate,
    interview_config,
    interview_evidence,
    interview_four_ranks,
    interview_measure,
    interview_train,
    interview_two_ranks,
    korthikanti_activation_bytes,
    paper_example,
)
from zeroedu.course.memory_timeline import MemoryRun, replay_peak, save_snapshot, timeline_run
from zeroedu.course.memory_timeline import plot as memory_plot
from zeroedu.course.offload import Table1Row, cpu_adam_node_seconds, offload_config, offload_runs, paper_table1
from zeroedu.course.scaling import ScalingRun, scaling_run, scaling_runs
from zeroedu.course.traces import TraceRun, collective_events, exposed_comm, trace_run

__all__ = [
    "DEEPSPEED_BUCKETS", "GLOBAL_BATCH", "LR", "STEPS", "compare_rows", "ds_config", "engine_summary",
    "local_engine", "markdown_table", "max_rel_diff", "min_time", "model_states", "one_step", "per_rank",
    "reference", "rel_weight_diff", "run_many", "show", "train", "bucket_stats", "cpu_adam_node_seconds",
    "offload_config", "offload_runs", "paper_table1", "show_source", "stage3_units", "Verdict", "Verdicts",
    "paper_example", "cheat_sheet_rows", "interview_config", "interview_train", "interview_measure",
    "interview_four_ranks", "interview_two_ranks", "interview_evidence", "cpu_adam_rate",
    "korthikanti_activation_bytes", "time_ring_collectives", "calibrate_link", "ledger_of_one_step",
    "clock_and_ledger", "slowest_rank_samples", "GB", "RING_SWEEP", "GRADES", "SHARDED", "BYTES_FORMULA",
    # seeing a step: who holds what (holdings), the profiler's trace (traces), torch's memory snapshot
    "AFTER_GATHER", "AFTER_REDUCE", "AFTER_STEP", "END", "Frame", "Holding", "Holdings", "Stepper", "holdings_run",
    "holdings_figure", "holding_rows", "holdings_strip", "MemoryRun", "replay_peak", "save_snapshot", "timeline_run",
    "memory_plot", "TraceRun", "collective_events", "exposed_comm", "trace_run",
    # notebook 07's results by name
    "Table1Row", "ScalingRun", "scaling_run", "scaling_runs",
]
