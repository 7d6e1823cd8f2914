"""zeroedu.graduate, notebook 14's harness: the same script under zeroedu and DeepSpeed 0.19.8 at world size 2.

What must hold whatever the CPU: the batch sizes and the lr per step are equal; zeroedu's meter on DeepSpeed's
tensors finds the stage-2 model states of the closed form (2 Psi parameters, 4 Psi / N master, 8 Psi / N Adam
state, bf16), equal to zeroedu's own; each checkpoint consolidates to its engine's fp32 master weights.
"""

from __future__ import annotations

import math

import pytest

import zeroedu
from zeroedu.models import TinyGPT

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.timeout(600)
N = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from zeroedu.graduate import compare

    # torch_adam: DeepSpeed steps torch's AdamW (weight decay 0) instead of compiling FusedAdam on a fresh machine
    cfg = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0,
                                                                        "torch_adam": True}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 4, "warmup_num_steps": 2}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 30_000},
           "comms_logger": {"enabled": True}}
    return zeroedu.launch(compare, world_size=N, args=(cfg, 2, str(tmp_path_factory.mktemp("ckpt"))), timeout=550)


def test_same_script_same_numbers(runs):
    ours, theirs = runs[0]["zeroedu"], runs[0]["deepspeed"]
    assert ours["batch"] == theirs["batch"] == [4, 1, 8]
    assert ours["lrs"] == theirs["lrs"]
    assert ours["losses"][0] == theirs["losses"][0]
    psi = sum(p.numel() for p in TinyGPT(seed=0).parameters())
    for r in (ours, theirs):
        states = r["model_states"]
        # Each pads its flat buffer a little (to N, and DeepSpeed to its alignment): theory up to that padding.
        assert 0 <= states["parameters"] - 2 * psi <= 2 * 64 * N
        assert 0 <= states["master_weights"] - 4 * math.ceil(psi / N) <= 4 * 64
        assert states["optimizer_state"] == 2 * states["master_weights"]
    for c in ("parameters", "master_weights", "optimizer_state"):
        assert ours["model_states"][c] == theirs["model_states"][c], c
    assert ours["optimizer"] == "Adam" and theirs["optimizer"] == "AdamW"   # torch's, in both
    for r in (ours, theirs):   # the tracked peak holds at least the model states and some activations
        assert r["peak_total"] > sum(r["model_states"].values()) and r["peak"]["activations"] > 0
    for r in (ours, theirs):
        assert r["consolidated"]["same_as_engine"]
        assert "latest" in r["files"]
