"""The step report (wall_clock_breakdown, comms_logger verbose) stays right after the timeline and the ledger trim.

Both lists keep a bounded window and let their oldest entries go in chunks (every ~1,667 steps at the defaults).
The test makes both windows a few steps long through their public knobs, so a run of 40 steps trims each many times,
and checks every step's report against records kept apart from those lists: sleeps of known length in each phase,
and the ledger's per-step call counts (aggregates that do not depend on which raw entries are kept).
"""

from __future__ import annotations

import re
import time

import torch

import zeroedu

SLEEP_MS = 2.0
STEPS = 40


def sleep(*_args) -> None:
    time.sleep(SLEEP_MS / 1e3)


def test_every_step_reports_its_phases_and_collectives_across_trims():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    engine, *_ = zeroedu.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}, "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True, "verbose": True}})
    engine.timeline.keep = 4           # 3 phases a step: trimmed every few steps
    engine.ledger.max_entries = 8      # 4 collectives a step (step 1: 4 more, the init broadcasts): the same
    engine.log_lines.keep = 10_000     # keep every printed line for the check
    model.register_forward_hook(sleep)
    model[0].weight.register_hook(sleep)
    engine.optimizer.register_step_pre_hook(sleep)
    for _ in range(STEPS):
        loss = engine(torch.randn(2, 8)).square().mean()
        engine.backward(loss)
        engine.step()
    assert engine.ledger.dropped > 0 and engine.timeline.appended > 2 * engine.timeline.keep   # both did trim

    blocks: dict[int, list[str]] = {}
    for line in engine.log_lines:
        if m := re.match(r"step=(\d+) time \(ms\) \| fwd: ([\d.]+) \| bwd: ([\d.]+) \| step: ([\d.]+)$", line):
            step = int(m[1])
            blocks[step] = []
            assert all(float(m[i]) >= SLEEP_MS for i in (2, 3, 4)), line
        elif not blocks and line.startswith("zeroedu note: "):   # initialize's notes on the config come first
            continue
        else:
            assert line.startswith("comm op: "), line
            blocks[step].append(line)
    assert sorted(blocks) == list(range(1, STEPS + 1))
    kinds = ("params", "grads", "scalar")
    for step, lines in blocks.items():
        # The ledger files a step's collectives under the step count before it (and the init broadcasts under 0).
        expected = engine.ledger.per_step(step - 1, kinds=kinds, field="calls")["total"]
        assert len(lines) == expected > 0, (step, lines)
        if step > 1:
            assert [ln.split(" | ")[0] for ln in lines] == ["comm op: reduce_scatter"] * 2 + ["comm op: all_gather"] * 2


def test_a_step_larger_than_the_window_says_so():
    """A window smaller than one step cannot hold the step: the report says what was lost and the knob to raise."""
    engine, *_ = zeroedu.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2}, "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True, "verbose": True}})
    engine.timeline.keep = 1
    engine.ledger.max_entries = 1
    for _ in range(2):
        engine.backward(engine(torch.randn(1, 4)).sum())
        engine.step()
    text = "\n".join(engine.log_lines)
    assert "raise engine.timeline.keep" in text and "raise engine.ledger.max_entries" in text


def test_a_timeline_keeps_its_window_and_count_through_pickle():
    """Rank results travel pickled (zeroedu.launch): the window, the count and the knob arrive as they were."""
    import pickle

    from zeroedu.report import Timeline

    t = Timeline()
    t.keep = 3
    for i in range(10):
        t.append(i)
    u = pickle.loads(pickle.dumps(t))
    assert type(u) is Timeline and list(u) == list(t) == [4, 5, 6, 7, 8, 9]
    assert (u.appended, u.keep) == (10, 3)
