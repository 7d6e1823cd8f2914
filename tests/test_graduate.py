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
    ours, theirs = runs[0].zeroedu, runs[0].deepspeed
    assert ours.batch == theirs.batch == (4, 1, 8) and ours.batch.micro == 4
    assert ours.lrs == theirs.lrs
    assert ours.losses[0] == theirs.losses[0]
    psi = sum(p.numel() for p in TinyGPT(seed=0).parameters())
    for r in (ours, theirs):
        states = r.model_states
        # Each pads its flat buffer a little (to N, and DeepSpeed to its alignment): theory up to that padding.
        assert 0 <= states["parameters"] - 2 * psi <= 2 * 64 * N
        assert 0 <= states["master_weights"] - 4 * math.ceil(psi / N) <= 4 * 64
        assert states["optimizer_state"] == 2 * states["master_weights"]
    for c in ("parameters", "master_weights", "optimizer_state"):
        assert ours.model_states[c] == theirs.model_states[c], c
    assert ours.optimizer == "Adam" and theirs.optimizer == "AdamW"   # torch's, in both
    for r in (ours, theirs):   # the tracked peak holds at least the model states and some activations
        assert r.peak_total > sum(r.model_states.values()) and r.peak["activations"] > 0
    for r in (ours, theirs):
        assert r.consolidated.same_as_engine
        assert "latest" in r.files
    assert runs[1].zeroedu.consolidated is None      # rank 0 consolidates


def _clipping(rank: int, world: int) -> dict:
    """A config without gradient_clipping, 3 steps under DeepSpeed as written, under zeroedu as written, and under
    zeroedu with the note's fix ("gradient_clipping": 1.0). The loss is scaled so that the norm is well above 1."""
    import torch
    import torch.nn.functional as F

    from zeroedu.graduate import library
    from zeroedu.models import MLP, shard_batch

    # SGD (a client torch optimizer, which DeepSpeed's ZeRO takes with zero_allow_untested_optimizer): its step is
    # proportional to the clipped gradient, so clipping shows in every later loss.
    base = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True}
    out = {}
    for key, name, cfg in (("deepspeed", "deepspeed", base), ("as_written", "zeroedu", base),
                           ("fixed", "zeroedu", {**base, "gradient_clipping": 1.0})):
        ds = library(name)
        model = MLP(seed=0)
        engine, *_ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), config=cfg)
        losses, norms = [], []
        for s in range(3):
            gen = torch.Generator().manual_seed(s)
            x, y = torch.randn(2 * world, 32, generator=gen), torch.randint(0, 10, (2 * world,), generator=gen)
            xs, ys = shard_batch(x, y, rank, world, 0, 1)
            loss = 50 * F.cross_entropy(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().reshape(1).double()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
            norms.append(engine.get_global_grad_norm())
        out[key] = {"losses": losses, "norms": norms,
                    "clip": engine.gradient_clipping() if name == "deepspeed" else engine.config.gradient_clipping,
                    "lines": list(getattr(engine, "log_lines", []))}
    return out


def test_gradient_clipping_left_out_is_deepspeeds_one_with_the_fix_and_a_note():
    """DeepSpeed 0.19.8 clips at 1.0 when a config leaves gradient_clipping out (GRADIENT_CLIPPING_DEFAULT in
    deepspeed/runtime/constants.py). zeroedu keeps 0 and says so in a note at initialize; with the note's fix it
    trains as DeepSpeed does."""
    r = zeroedu.launch(_clipping, world_size=N, timeout=550)[0]
    ds, as_written, fixed = r["deepspeed"], r["as_written"], r["fixed"]
    assert ds["clip"] == 1.0 and as_written["clip"] == 0.0
    assert all(n > 1.0 for n in ds["norms"]), ds["norms"]   # DeepSpeed's clipping is at work every step
    assert fixed["losses"] == pytest.approx(ds["losses"], rel=1e-5), (fixed["losses"], ds["losses"])
    assert as_written["losses"][0] == ds["losses"][0]
    assert all(abs(a - b) > 1e-2 * b for a, b in zip(as_written["losses"][1:], ds["losses"][1:], strict=True))
    assert sum("'gradient_clipping' is left out" in line and "1.0" in line for line in as_written["lines"]) == 1
    assert not any("'gradient_clipping' is left out" in line for line in fixed["lines"])
