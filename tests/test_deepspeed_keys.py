"""DeepSpeed's keys that change behaviour, implemented: each run next to the one without it, on real ranks.

The references are independent of the code under test: a single-process run (tests/reference.py), closed-form
ring volumes, torch's own schedulers and DeepSpeed's DynamicLossScaler.
"""

from __future__ import annotations

import math

import pytest
import torch

import zeroedu
from zeroedu.precision import LossScaler

from reference import param_rel, rel, single_process

pytestmark = pytest.mark.timeout(600)
N = 2


@pytest.fixture(scope="module")
def keys():
    from graduation_workers import zero_keys

    return zeroedu.launch(zero_keys, world_size=N, timeout=550)


def ring(nbytes: int, op: str) -> int:
    return (2 if op == "all_reduce" else 1) * (N - 1) * nbytes // N


def test_reduce_scatter_false_all_reduces_each_bucket(keys):
    r = keys[0]
    ref_losses, _ = single_process("gpt", steps=3, precision="bf16")
    for stage in (1, 2, 3):
        rs, ar = r[f"s{stage}"], r[f"s{stage}-allreduce"]
        assert ar["losses"] == rs["losses"] and param_rel(ar["params"], rs["params"]) == 0.0, stage
        assert rel(ar["losses"], ref_losses) < 2e-2
        step = ar["ledger"][1]
        assert "backward/reduce_scatter" not in step and "backward/reduce_scatter" in rs["ledger"][1]
        # The same buckets: all-reduce sends twice what reduce-scatter does, 2 (N-1)/N S against (N-1)/N S.
        assert step["backward/all_reduce"] == 2 * rs["ledger"][1]["backward/reduce_scatter"]
        padded_bytes = 2 * sum(math.ceil(n / N) * N for n in rs["layout"])    # bf16 gradients, every bucket padded
        if stage < 3:
            assert step["backward/all_reduce"] == ring(padded_bytes, "all_reduce")
            # The paper's 2 Psi becomes 3 Psi: gradients all-reduced (2 Psi) plus parameters all-gathered (Psi).
            assert step["total"] * 2 == rs["ledger"][1]["total"] * 3


def test_allgather_bucket_size_cuts_the_parameter_gather(keys):
    r = keys[0]
    for key, base in (("s2-gather5000", "s2"), ("s1-gather100k", "s1-fp32")):
        ours, ref = r[key], r[base]
        assert ours["losses"] == ref["losses"] and param_rel(ours["params"], ref["params"]) == 0.0
        assert ours["ledger"][1]["step/all_gather"] == ref["ledger"][1]["step/all_gather"]   # the same bytes
    # How many all-gathers: without the key, one for every bucket where the gather packs nothing (gloo's "auto"
    # runs direct), one per bucket where a coalesced gather would pack them into one more buffer (the ring); with
    # the key, this rank's shard in parts of allgather_bucket_size / N elements, whatever the buckets (smaller
    # ones, then larger ones than a bucket).
    base = r["s2-count"]
    assert base["buckets"] > 1 and base["gathers"] == 1
    assert r["s2-count-ring"]["gathers"] == r["s2-count-ring"]["buckets"] == base["buckets"]
    assert r["s2-count5000"]["gathers"] == math.ceil(base["shard"] / (5000 // N)) > base["buckets"]
    assert r["s1-count100k"]["gathers"] == math.ceil(base["shard"] / (100_000 // N)) < base["buckets"]


def test_contiguous_gradients_false_keeps_no_bucket_buffers(keys):
    """zeroedu makes each bucket's buffer when the bucket fills and frees it once reduced (issue 21), so with or
    without contiguous_gradients no bucket buffer is left between steps, and the training is the same."""
    r = keys[0]
    for stage in (2, 3):
        ours, ref = r[f"s{stage}-noncontiguous"], r[f"s{stage}"]
        assert ours["losses"] == ref["losses"] and param_rel(ours["params"], ref["params"]) == 0.0
        assert ours["memory"]["resident"].get("buckets", 0) == ref["memory"]["resident"].get("buckets", 0) == 0
        assert ours["ledger"][1] == ref["ledger"][1]


def test_sub_group_size_steps_in_parts_and_lowers_the_step_peak(keys):
    whole, sub = keys[0]["s2-whole"], keys[0]["s2-sub4000"]
    assert len(whole["groups"]) == 1 and len(sub["groups"]) > 2
    for group in sub["groups"]:   # greedy: a group overflows 4000 only when it is a single piece
        assert sum(sub["pieces"][i] for i in group) <= 4000 or len(group) == 1
    assert param_rel(sub["params"], whole["params"]) == 0.0
    # bf16 gradients become fp32 for the step: the whole shard at once, or one sub-group at a time.
    shard = sum(whole["pieces"])
    biggest = max(sum(sub["pieces"][i] for i in g) for g in sub["groups"])
    saved = whole["peak"]["temporaries"] - sub["peak"]["temporaries"]
    assert saved >= 4 * (shard - biggest) * 0.9, (saved, shard, biggest)


def test_loss_scaler_matches_deepspeeds():
    """zeroedu's LossScaler and DeepSpeed's DynamicLossScaler fed the same overflows (in a launched rank:
    DeepSpeed's scaler asks its comm layer for the rank)."""
    pytest.importorskip("deepspeed")
    from graduation_workers import loss_scales

    gen = torch.Generator().manual_seed(0)
    pattern = (torch.rand(400, generator=gen) < 0.08).tolist()
    cases = [(c, w, h) for c in (False, True) for w, h in ((3, 1), (5, 2), (2, 3))]
    got = zeroedu.launch(loss_scales, world_size=1, args=(pattern, cases), timeout=200)[0]
    for case, (ours, theirs) in zip(cases, got, strict=True):
        assert ours == theirs, case
        assert len(set(ours)) > 3   # the pattern moves the scale both ways
    static = LossScaler.from_config(zeroedu.load_config({"fp16": {"enabled": True, "loss_scale": 512}}).fp16)
    static.update(True)
    assert static.scale == 512 and not static.dynamic


@pytest.fixture(scope="module")
def clients():
    from graduation_workers import client_objects

    return zeroedu.launch(client_objects, world_size=N, timeout=550)[0]


def test_client_optimizer_is_read_and_sharded_as_the_configs(clients):
    ours, ref = clients["client-adamw"], clients["config-adamw"]
    assert ours["optimizer"] == "AdamW" and ours["defaults"] == ref["defaults"]
    assert ours["losses"] == ref["losses"] and param_rel(ours["params"], ref["params"]) == 0.0


def test_client_schedulers_step_with_the_engine(clients):
    from reference import LR

    def torch_lrs(make_sched, steps=4):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        sched = make_sched(opt)
        lrs = []
        for _ in range(steps):
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    assert clients["client-steplr"]["lrs"] == torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    assert clients["callable-lambda"]["lrs"] == torch_lrs(
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)))
    assert clients["config-warmup"]["lrs"] == pytest.approx(
        [0.0, LR * math.log(2) / math.log(3), LR, LR], rel=1e-12)
    assert clients["config-warmup"]["sched"] == "WarmupLR"
    assert clients["model-parameters"]["lrs"] == [2 * LR] * 4


def test_what_initialize_cannot_honour_is_a_clear_error():
    from reference import make

    m = make("gpt")
    params = list(m.parameters())
    cases = [
        (dict(optimizer=torch.optim.RMSprop(m.parameters())), "RMSprop; zeroedu implements"),
        (dict(optimizer=torch.optim.AdamW([{"params": params[:2], "lr": 1e-3},
                                           {"params": params[2:], "lr": 1e-2}])), "different 'lr'"),
        (dict(optimizer="adam"), "must be a torch.optim.Optimizer"),
        (dict(mpu=object()), "model parallelism"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError)) as e:
            zeroedu.initialize(model=m, config={}, **kwargs)
        assert message in str(e.value), (kwargs, str(e.value))


def test_logging_keys_print_from_the_ledger_and_meter():
    from graduation_workers import logging_keys

    r = zeroedu.launch(logging_keys, world_size=N, timeout=300)[0]
    lines = r["lines"]
    progress = [x for x in lines if x.startswith("step=") and "skipped=" in x]
    assert [x.split(",")[0] for x in progress] == ["step=2", "step=4"]
    assert all("lr=[0.001]" in x and "loss=" in x and "loss_scale=" in x for x in progress)
    assert len([x for x in lines if " time (ms) | fwd: " in x and "| bwd: " in x and "| step: " in x]) == 4
    memory = [x for x in lines if " memory (bytes, rank 0) | " in x]
    assert len(memory) == 4 and f"master_weights: {r['resident']['master_weights']:,}" in memory[-1]
    ops = [x for x in lines if x.startswith("comm op: ")]
    assert len(ops) == sum(n for op, n in r["counts"].items() if op != "skipped_step")   # every collective, once
    body = r["summary"].splitlines()[1:]
    assert sum(int(row.split()[2]) for row in body) == sum(n for op, n in r["counts"].items() if op != "skipped_step")


def test_client_adam_and_sgd_instances_train_as_their_config_equivalents():
    """initialize(optimizer=torch.optim.Adam(...) / SGD(...)) reads the class and hyperparameters and shards the
    state as the config's optimizer section would: the same losses and weights as the config run, at stage 2."""

    def worker(rank: int, world: int) -> dict:
        import torch

        import zeroedu

        from reference import LR, make
        from workers import config, run_steps

        base = {k: v for k, v in config(2).items() if k != "optimizer"}
        cases = {
            # torch_adam: torch's Adam, as the client's (without it DeepSpeed builds its FusedAdam, zeroedu torch's
            # fused kernel; they differ from the client's loop kernel by about one rounding)
            "Adam": ({"type": "Adam", "params": {"lr": LR, "betas": [0.8, 0.99], "eps": 1e-7, "torch_adam": True}},
                     lambda ps: torch.optim.Adam(ps, lr=LR, betas=(0.8, 0.99), eps=1e-7)),
            "SGD": ({"type": "SGD", "params": {"lr": 10 * LR, "momentum": 0.9, "nesterov": True}},
                    lambda ps: torch.optim.SGD(ps, lr=10 * LR, momentum=0.9, nesterov=True)),
        }
        out = {}
        for name, (section, make_opt) in cases.items():
            for how in ("config", "client"):
                model = make("gpt")
                kw = {"config": {**base, "optimizer": section}} if how == "config" else \
                    {"config": base, "optimizer": make_opt(model.parameters())}
                engine, *_ = zeroedu.initialize(model=model, **kw)
                losses = run_steps(engine, "gpt", rank, world, 3)
                out[(name, how)] = {"losses": losses, "params": engine.master_state_dict(),
                                    "class": type(engine.optimizer).__name__}
        return out

    r = zeroedu.launch(worker, world_size=N, timeout=300)[0]
    for name in ("Adam", "SGD"):
        ours, ref = r[(name, "client")], r[(name, "config")]
        assert ours["class"] == ref["class"] == name
        assert ours["losses"] == ref["losses"] and param_rel(ours["params"], ref["params"]) == 0.0, name


def test_log_lines_keep_a_bounded_window():
    """A long run that prints every step (steps_per_print 1, wall_clock_breakdown) keeps the newest lines only."""
    from zeroedu.engine import TIMELINE_KEEP

    engine, *_ = zeroedu.initialize(model=torch.nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for i in range(3 * TIMELINE_KEEP):
        engine.log(f"line {i}")
    assert TIMELINE_KEEP <= len(engine.log_lines) <= 2 * TIMELINE_KEEP
    assert engine.log_lines[-1] == f"line {3 * TIMELINE_KEEP - 1}"
