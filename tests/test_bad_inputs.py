"""Inputs the engine cannot train right get an error that names the problem and the fix (issue 36, items 4 and 7):
never a raw IndexError from the flat layout, never a silent cast. Each case runs in a fresh process, a world of
one (initialize() outside launch), except the launch case, which starts real ranks."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zeroedu.launch import launch

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python (a world of one), with this tree's zeroedu."""
    prelude = "import torch, torch.nn as nn, zeroedu\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


NO_TRAINABLE = {
    "empty": "nn.Module()",
    "buffers only": "nn.BatchNorm1d(4, affine=False)",
    "all frozen": "nn.Linear(4, 4).requires_grad_(False)",
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_model_without_trainable_parameters_is_named(stage):
    cases = "\n".join(
        f"try:\n"
        f"    zeroedu.initialize(model={model}, config={{'zero_optimization': {{'stage': {stage}}}}})\n"
        f"    print('{name}: no error')\n"
        f"except ValueError as e:\n"
        f"    print('{name}: ValueError:', str(e).splitlines()[0])\n"
        for name, model in NO_TRAINABLE.items())
    out = _run(cases)
    for name in NO_TRAINABLE:
        line = next((x for x in out.stdout.splitlines() if x.startswith(name + ":")), out.stderr[-3000:])
        assert "ValueError" in line and "no trainable parameters" in line, line


def test_float64_parameters_are_not_cast_to_fp32_silently():
    out = _run("try:\n"
               "    zeroedu.initialize(model=nn.Linear(4, 4).double(), config={'zero_optimization': {'stage': 1}})\n"
               "    print('no error')\n"
               "except ValueError as e:\n"
               "    print('ValueError:', e)\n")
    assert "ValueError" in out.stdout and "float64" in out.stdout and ".float()" in out.stdout, \
        out.stdout + out.stderr[-3000:]


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def test_world_size_may_be_a_numpy_integer():
    assert launch(_rank_and_world, np.int64(2)) == [(0, 2), (1, 2)]
    with pytest.raises(ValueError, match="world_size must be an int"):
        launch(_rank_and_world, np.float64(2.0))


TRAIN = """
import warnings
warnings.simplefilter("always")
engine, *_ = zeroedu.initialize(model=nn.Linear(8, 8), config={CONFIG})
with warnings.catch_warnings(record=True) as seen:
    for step in range(1, {STEPS} + 1):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step)).to(engine.dtype)
        loss = engine(x).square().mean()
        print(f"loss {step}: {loss.item()}")
        engine.backward(loss)
        engine.step()
        for w in seen:
            print(f"after step {step}: {w.message}")
        seen.clear()
"""


def test_a_static_loss_scale_that_skips_every_step_warns_at_the_first():
    # 1e300 is refused by the config now (loss_scale is bounded at 2^64); 2^40 passes it and still turns every fp16
    # gradient of this model into inf (fp16's largest value is 65504), so every step is skipped.
    cfg = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 2.0 ** 40},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    out = _run(TRAIN.replace("{CONFIG}", repr(cfg)).replace("{STEPS}", "5"))
    warned = [x for x in out.stdout.splitlines() if "zeroedu:" in x]
    assert len(warned) == 1 and warned[0].startswith("after step 1:"), out.stdout + out.stderr[-3000:]
    assert "optimizer step 1 was skipped" in warned[0] and "static fp16.loss_scale" in warned[0], warned


def test_a_learning_rate_that_trains_into_nan_warns_at_that_step():
    # lr 1e30 is refused by the config now (lr is bounded at 1e3); SGD at 1e3 passes it and still diverges: each step
    # multiplies the gradient's scale, and the loss leaves the floats within a few steps.
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e3}},
           "zero_optimization": {"stage": 2}}
    out = _run(TRAIN.replace("{CONFIG}", repr(cfg)).replace("{STEPS}", "14"))
    warned = [x for x in out.stdout.splitlines() if "zeroedu:" in x]
    assert len(warned) == 1, out.stdout + out.stderr[-3000:]
    # The first step whose loss (as the training loop itself printed it) is not finite is the step named.
    losses = {int(x.split()[1].rstrip(":")): float(x.split()[2]) for x in out.stdout.splitlines()
              if x.startswith("loss ")}
    first = min(k for k, v in losses.items() if not math.isfinite(v))
    assert first >= 2, losses   # step 1 trains on finite weights
    assert warned[0].startswith(f"after step {first}:"), (warned, losses)
    assert f"at optimizer step {first} " in warned[0] and "training diverged" in warned[0], warned


def test_a_step_without_backward_is_named_at_every_stage():
    """engine.step() with no engine.backward() since the last step: at stage 1 it used to fail with a TypeError
    deep inside the flat layout, and at stages 0, 2 and 3 it stepped Adam on zero gradients, advancing its step
    count (so its bias correction) with nothing behind it. Now each stage says what is missing, at that step."""
    out = _run(
        "from zeroedu.models import TinyGPT, gpt_batch, gpt_loss\n"
        "for stage in range(4):\n"
        "    e, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config={'gradient_clipping': 0,\n"
        "                                                                     'zero_optimization': {'stage': stage}})\n"
        "    for when in ('first', 'after a step'):\n"
        "        try:\n"
        "            e.step()\n"
        "            print(stage, when, 'stepped')\n"
        "        except RuntimeError as err:\n"
        "            print(stage, when, err)\n"
        "        x, y = gpt_batch(0, 2)\n"
        "        e.backward(gpt_loss(e(x), y)); e.step()\n")
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8, out.stderr[-3000:]
    for line, (stage, step) in zip(lines, [(s, n) for s in range(4) for n in (1, 2)], strict=True):
        assert line.startswith(f"{stage} "), line
        assert (f"engine.step() at optimizer step {step} with no engine.backward(loss) since the last step" in line
                and "Call engine.backward(loss)" in line), line
