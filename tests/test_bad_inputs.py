"""Inputs the engine cannot train right get an error that names the problem and the fix (issue 36, items 4 and 7):
never a raw IndexError from the flat layout, never a silent cast. Each case runs in a fresh process, a world of
one (initialize() outside launch), except the launch case, which starts real ranks."""

from __future__ import annotations

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
