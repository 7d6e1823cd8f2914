"""DeepSpeed's LR schedules and batch arithmetic, compared with DeepSpeed 0.19.8 itself.

Two levels: zeroedu.schedulers against DeepSpeed's scheduler classes over the same torch optimizer, step by step
(in this process); and whole engines, `zeroedu.initialize` and `deepspeed.initialize` on the same configs at world
size 2 (real ranks over gloo): the batch sizes each derives from train_batch_size, and engine.get_lr() after every
optimizer step, must be equal; a config one refuses, the other must refuse too.
"""

from __future__ import annotations

import pytest
import torch

import zeroedu
from zeroedu import schedulers
from zeroedu.config import ConfigError, load_config

lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")

CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 0.1, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0.001, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 3, "cos_min_ratio": 0.2, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "decay_lr_rate": 0.5,
                  "decay_step_size": 2, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_second_step_size": 3,
                  "cycle_first_stair_count": 3, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}),
    ("OneCycle", {"cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 3, "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 0.5}),
]


@pytest.mark.parametrize("opt", ["Adam", "SGD"])
@pytest.mark.parametrize("kind,params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_every_step_equals_deepspeeds_class(kind, params, opt):
    def optimizer():
        return getattr(torch.optim, opt)([torch.nn.Parameter(torch.zeros(3))], lr=0.05)

    theirs, ours = optimizer(), optimizer()
    ds_sched = getattr(lr_schedules, kind)(theirs, **params)
    zs_sched = schedulers.build(kind, params, ours)
    for step in range(30):
        a, b = theirs.param_groups[0], ours.param_groups[0]
        assert a["lr"] == b["lr"], (step, a["lr"], b["lr"])
        assert a.get("betas") == b.get("betas"), (step, a.get("betas"), b.get("betas"))
        ds_sched.step()
        zs_sched.step()
    assert zs_sched.state_dict() == ds_sched.state_dict()


def test_known_values_by_hand():
    """The documented formulas at a few points, written out (independent of both implementations)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = schedulers.build("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 100}, opt)
    s.step()
    assert opt.param_groups[0]["lr"] == 0.0            # ln(1) / ln(100) after the first step
    for _ in range(9):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)   # ln(10) / ln(100)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    s = schedulers.build("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 2, "cos_min_ratio": 0.0}, opt)
    for _ in range(6):
        s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.5)   # halfway down the cosine: iteration 5 of 2..10


def test_config_checks_scheduler_params():
    def err(cfg) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(cfg)
        return str(e.value)

    assert "'scheduler.params.total_num_steps' is required by WarmupDecayLR" in err(
        {"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    assert "Did you mean 'WarmupLR'" in err({"scheduler": {"type": "WarmupLr"}})
    assert "'scheduler.params.warmup_type' must be 'log' or 'linear'" in err(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})
    assert "Did you mean 'scheduler.params.warmup_num_steps'" in err(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}})
    assert "one parameter group" in err({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}})
    c = load_config({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})
    assert c.scheduler.type == "OneCycle" and c.scheduler.params["cycle_max_lr"] == 1e-3


# torch_adam: DeepSpeed steps torch's Adam(W) instead of compiling its FusedAdam extension on first use (minutes on
# a 2-core machine with an empty ~/.cache/torch_extensions); the schedules and batch sizes compared do not depend
# on it. zeroedu accepts the key with a note (it always steps torch's Adam).
OPT = {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "weight_decay": 0.0}}


def engine_runs() -> list[tuple[str, dict, int]]:
    """Configs (key, config, optimizer steps) run by both engines: every schedule and every batch-key combination."""
    runs = []
    for i, (kind, params) in enumerate(CASES):
        runs.append((f"sched-{kind}-{i}", {"train_batch_size": 4, "optimizer": OPT,
                                           "scheduler": {"type": kind, "params": params}}, 8))
    batches = {
        "all-three": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
        "tbs+micro": {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2},
        "tbs+accum": {"train_batch_size": 12, "gradient_accumulation_steps": 3},
        "micro+accum": {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
        "tbs-only": {"train_batch_size": 6},
        "micro-only": {"train_micro_batch_size_per_gpu": 5},
        "mismatch": {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
        "tbs+micro-not-whole": {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        "tbs-odd": {"train_batch_size": 5},
        "tbs+accum-too-small": {"train_batch_size": 4, "gradient_accumulation_steps": 4},
    }
    for key, b in batches.items():
        runs.append((f"batch-{key}", {**b, "optimizer": OPT,
                                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}, 2))
    return runs


@pytest.fixture(scope="module")
def both_engines():
    from graduation_workers import lr_trace

    runs = [(key + "/" + name, name, cfg, steps) for key, cfg, steps in engine_runs()
            for name in ("zeroedu", "deepspeed")]
    return zeroedu.launch(lr_trace, world_size=2, args=(runs,), timeout=600)[0]


@pytest.mark.timeout(700)
def test_engines_derive_the_same_batches_and_lr_per_step(both_engines):
    refused = []
    for key, _, _ in engine_runs():
        ours, theirs = both_engines[key + "/zeroedu"], both_engines[key + "/deepspeed"]
        if "error" in theirs:
            assert "error" in ours, (key, ours, theirs)
            assert ours["error"].startswith("ConfigError") and "train_batch_size" in ours["error"], ours
            refused.append(key)
            continue
        assert ours == theirs, (key, ours, theirs)
    assert sorted(refused) == ["batch-mismatch", "batch-tbs+accum-too-small", "batch-tbs+micro-not-whole",
                               "batch-tbs-odd"]


def test_batch_errors_show_the_arithmetic():
    c = load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError) as e:
        c.for_world(2)
    assert "2 x 2 x 2 = 8, but train_batch_size is 10" in str(e.value) and "Write train_batch_size 8" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}).for_world(2)
    assert "10 / 8 = 1.25" in str(e.value) and "Write train_batch_size 8 or 16" in str(e.value)
    c = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 4}).for_world(4)
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == (2, 4, 32)
    assert load_config({"train_micro_batch_size_per_gpu": 3}).for_world(4).train_batch_size == 12


def _resume_rank(rank: int, world_size: int, ckpt: str) -> dict:
    """WarmupLR over 6 steps: 3 steps, save, then 3 more; a fresh engine loads after step 3 and steps 3 more."""
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 6, "warmup_type": "linear"}},
           "zero_optimization": {"stage": 2}}

    def run(engine, steps):
        lrs = []
        for s in steps:
            x, y = shard_batch(*mlp_batch(s, 2 * world_size), rank, world_size)
            engine.backward(mlp_loss(engine(x), y))
            engine.step()
            lrs.append(engine.get_lr()[0])
        return lrs

    straight, *_ = zeroedu.initialize(model=MLP(seed=0), config=cfg)
    first = run(straight, range(3))
    straight.save_checkpoint(ckpt)
    rest = run(straight, range(3, 6))
    resumed, *_ = zeroedu.initialize(model=MLP(seed=0), config=cfg)
    resumed.load_checkpoint(ckpt)
    return {"first": first, "rest": rest, "resumed": run(resumed, range(3, 6))}


def test_a_checkpoint_keeps_the_schedule_position(tmp_path):
    """Resumed after step 3, the learning rate goes on as the uninterrupted run's (a schedule restarted from
    step 0 would repeat the first three, smaller, rates)."""
    out = zeroedu.launch(_resume_rank, world_size=2, args=(str(tmp_path),))
    for r in out:
        lrs = r["first"] + r["rest"]
        assert lrs == sorted(lrs) and lrs[0] < lrs[3]     # still warming up: every rate above the one before
        assert r["resumed"] == r["rest"]
