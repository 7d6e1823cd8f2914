"""Ranks that drift apart are named where the drift began (zeroedu.comm.agreement), with real processes and gloo.

The probe behind issue 36: a rank that skips engine.step() once, with the README's TinyGPT at stage 1, made the
ranks exchange the wrong tensors for the rest of the run (equal sizes: gloo matched them) and the only error came
at the end. These tests train real engines on real ranks and check that the error comes at the next step, names
the rank that skipped, and shows every rank's call line.
"""

from __future__ import annotations

import re
import sys
import time

import cloudpickle
import pytest
import torch

import zeroedu
from zeroedu.launch import LaunchError, launch
from zeroedu.models import MLP, TinyGPT, gpt_batch, gpt_loss, shard_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 8


def _config(stage: int, bucket: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}


def _skip_one_step(rank: int, world_size: int, stage: int, model: str, skip_at: int) -> int:
    """Rank 1 skips engine.step() once, at step `skip_at`; returns the steps it got through."""
    torch.manual_seed(0)
    net = TinyGPT() if model == "gpt" else MLP()
    engine, *_ = zeroedu.initialize(model=net, config=_config(stage, 20000 if model == "gpt" else 2000))
    for step in range(STEPS):
        if model == "gpt":
            x, y = shard_batch(*gpt_batch(step, 2 * world_size), rank, world_size)
            loss = gpt_loss(engine(x), y)
        else:
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2 * world_size, 32, generator=g)
            x = x[rank * 2:(rank + 1) * 2]
            loss = engine(x).square().mean()
        engine.backward(loss)
        if not (rank == 1 and step == skip_at):
            engine.step()
    return STEPS


@pytest.mark.parametrize("stage,model", [(1, "gpt"), (1, "mlp"), (2, "mlp"), (0, "mlp")])
def test_a_rank_that_skips_step_is_named_at_the_next_step(stage, model):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(_skip_one_step, 2, args=(stage, model, 2), hang_timeout=60)
    text = str(err.value)
    # Either the per-step check caught it (sizes matched: gloo saw nothing), or gloo aborted (sizes differed)
    # and the launcher compared the ranks' records; both name rank 1, whatever rank gloo happened to kill.
    assert "rank(s) 1 " in text and "skipped engine.step()" in text, text
    if "collective drift" in text:
        assert "between optimizer steps 2 and 3" in text, text   # the drift began at the third step
    else:
        assert "rank 1 (differs): after 2 optimizer steps, 2 backward()" in text, text
    # Each rank's call line: the line of this file that called engine.backward() or engine.step().
    assert text.count("test_agreement.py:") >= 2, text
    assert time.monotonic() - t0 < 60


def test_at_four_ranks_the_rank_that_skips_step_is_named_not_the_one_gloo_stopped():
    """The probe: at 4 ranks, gloo's abort blamed rank 2, which did nothing wrong. A majority names rank 1."""
    with pytest.raises(LaunchError) as err:
        launch(_skip_one_step, 4, args=(1, "mlp", 2), hang_timeout=90)
    text = str(err.value)
    assert "rank(s) 1 " in text and "skipped engine.step()" in text, text
    assert "rank 1 (differs)" in text and not re.search(r"rank [023] \(differs\)", text), text


def _in_step(rank: int, world_size: int) -> None:
    engine, *_ = zeroedu.initialize(model=MLP(), config=_config(1, 2000))
    for _ in range(3):
        loss = engine(torch.randn(2, 32)).square().mean()
        engine.backward(loss)
        engine.step()
    return engine.comm.agreement.checks


def test_agreeing_ranks_train_on():
    assert launch(_in_step, 2) == [3, 3]


class _HookError(Exception):
    pass


def _swallow_hook_error(rank: int, world_size: int, stage: int) -> int:
    """Rank 1's backward hook raises at step 2; the training loop catches it and goes on."""
    torch.manual_seed(0)
    net = MLP()
    state = {"step": 0}

    def hook(grad):
        if rank == 1 and state["step"] == 2:
            raise _HookError("a learner's hook failed")
        return grad

    net.layers[1].weight.register_hook(hook)
    engine, *_ = zeroedu.initialize(model=net, config=_config(stage, 2000))
    for step in range(STEPS):
        state["step"] = step
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * world_size, 32, generator=g)[rank * 2:(rank + 1) * 2]
        try:
            engine.backward(engine(x).square().mean())
        except _HookError:
            pass   # swallowed: the run goes on
        engine.step()
    return STEPS


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_rank_that_swallows_an_exception_from_backward_is_named(stage):
    with pytest.raises(LaunchError) as err:
        launch(_swallow_hook_error, 2, args=(stage,), hang_timeout=60)
    text = str(err.value)
    assert "rank(s) 1 " in text and "raise part-way" in text, text


def _drift_at_the_end(rank: int, world_size: int, how: str, save_dir: str | None, stage: int = 1) -> int:
    """Ranks that agree until the end: "swap" (rank 1 calls step() before backward() in the final step only) or
    "late" (rank 1 skips step() in the next-to-last step and calls it twice in the last). The collectives' counts
    and sizes still match (one bucket: the gradient reduce-scatter and the parameter all-gather move equal pieces),
    so every collective completes and the run used to end without a word."""
    torch.manual_seed(0)
    engine, *_ = zeroedu.initialize(model=MLP(), config=_config(stage, 10**8))
    # Both misuses call step() with no backward() since the step before, which the engine refuses at once (with
    # its own message, tests/test_bad_inputs.py); off here, to show the agreement check catches the drift behind it.
    engine.requires_backward_before_step = False
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * world_size, 32, generator=g)[rank * 2:(rank + 1) * 2]
        loss = engine(x).square().mean()
        odd = rank == 1
        if odd and how == "swap" and step == STEPS - 1:
            engine.step()
            engine.backward(loss)
            continue
        engine.backward(loss)
        if odd and how == "late" and step == STEPS - 2:
            continue
        engine.step()
        if odd and how == "late" and step == STEPS - 1:
            engine.step()
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    return STEPS


# Stage 2: at stage 1 a step() with no backward() since the previous step fails on its own (no gradient shard).
@pytest.mark.parametrize("how,stage,began,ops", [("swap", 2, STEPS, ("reduce_scatter", "all_gather")),
                                                  ("late", 2, STEPS - 1, ("all_gather", "reduce_scatter"))])
def test_a_drift_in_the_last_steps_is_named_before_the_run_ends(how, stage, began, ops):
    with pytest.raises(LaunchError) as err:
        launch(_drift_at_the_end, 2, args=(how, None, stage), hang_timeout=60)
    text = str(err.value)
    # Named at the step where the drift began (not the run's end), with the line where each rank's collectives part.
    assert "raised CollectiveDriftError: collective drift: rank(s) 1 " in text, text
    assert f"between optimizer steps {began - 1} and {began} " in text, text
    # Two ranks, no majority: what each called where they part, and from which line (backward() or step()'s).
    assert re.search(rf"They part at collective #\d since the previous check: rank 0 called {ops[0]} [^;]* from "
                     rf"test_agreement\.py:\d+; rank 1 called {ops[1]} [^;]* from test_agreement\.py:\d+\.", text), text
    if how == "swap":   # the final step's check: read only once fn returned, where every rank finishes its checks
        assert "in finish_all" in text, text


def test_a_drift_in_the_last_step_stops_the_checkpoint_save(tmp_path):
    with pytest.raises(LaunchError) as err:
        launch(_drift_at_the_end, 2, args=("swap", str(tmp_path), 2), hang_timeout=60)
    text = str(err.value)
    assert f"between optimizer steps {STEPS - 1} and {STEPS} " in text and "save_checkpoint" in text, text
    assert not list(tmp_path.glob("global_step*")), list(tmp_path.iterdir())   # nothing saved of the drifted steps
