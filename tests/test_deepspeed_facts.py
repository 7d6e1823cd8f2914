"""What the course says DeepSpeed 0.19.8 does, checked against DeepSpeed itself: its config defaults (read from its
own pydantic models) and a run of real DeepSpeed on 2 gloo ranks, next to zeroedu's
`use_multi_rank_bucket_allreduce` on the same model (issue 29).

The closed forms are the ring volumes, written here in 16-bit or 32-bit ELEMENTS of the padded buckets: an
all-reduce sends 2 (N-1)/N of its buffer, a reduce-scatter or an all-gather (N-1)/N. So a stage 1-2 step sends
2 (N-1)/N Psi elements by the paper (reduce-scatter + all-gather) and 3 (N-1)/N Psi by DeepSpeed's default
(all-reduce + all-gather).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import zeroedu
from zeroedu.config import load_config

from reference import rel, single_process

pytestmark = pytest.mark.timeout(600)
N = 2


def test_deepspeed_defaults_the_course_quotes():
    """Each default the notebooks quote, read from DeepSpeed's own config models."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig()
    # Fact 1: stages 1-2 all-reduce every gradient bucket by default (3 Psi elements a step, not 2 Psi).
    assert z.use_multi_rank_bucket_allreduce is True and z.reduce_scatter is True
    # Fact 8: the bucket caps are 5e8 elements, not 5e7 (5e7 is stage 3's prefetch bucket).
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.prefetch_bucket_size == 50_000_000 and z.max_live_parameters == 1_000_000_000
    # Fact 1's ZeRO-3 half: the reuse distance is 1e9 elements, so a small model is gathered once a step.
    assert z.max_reuse_distance == 1_000_000_000 and z.param_persistence_threshold == 100_000
    # Fact 3: the global gradient norm is computed (an all-reduce of a scalar) unless switched off.
    assert z.compute_grad_norm is True and DeepSpeedBF16Config().check_grad_overflow is True
    # Fact 7 and item 11: overlap_comm is on at stage 3 only; sub_group_size 1e9; round_robin_gradients off.
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert z.sub_group_size == 1_000_000_000 and z.round_robin_gradients is False
    # A tiny saved model at stage 3: the 16-bit weights are not gathered on save unless asked.
    assert z.gather_16bit_weights_on_model_save is False


def test_zeroedu_reads_the_key_and_keeps_the_papers_default():
    zc = load_config({"zero_optimization": {"stage": 2}}).zero_optimization
    assert zc.use_multi_rank_bucket_allreduce is False
    on = load_config({"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": True}})
    assert on.zero_optimization.use_multi_rank_bucket_allreduce is True
    with pytest.raises(zeroedu.config.ConfigError, match="use_multi_rank_bucket_allreduce"):
        load_config({"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": "yes"}})


def _cfg(stage: int, allreduce: bool, precision: str = "fp32", accum: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 8 // (N * accum), "gradient_accumulation_steps": accum,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                  "use_multi_rank_bucket_allreduce": allreduce, **zero}}


def _zeroedu_runs(rank: int, world: int) -> dict:
    from workers import train

    out = {}
    for stage in (1, 2):
        for allreduce in (False, True):
            for accum in (1, 2):
                r = train(rank, world, "gpt", _cfg(stage, allreduce, accum=accum), steps=3)
                out[stage, allreduce, accum] = {"losses": r["losses"], "ledger": r["ledger"][1],
                                                "layout": r["layout"], "params": r["params"]}
    # Stage 3 has no such key in DeepSpeed: the same bytes with it on.
    for allreduce in (False, True):
        out[3, allreduce, 1] = {"ledger": train(rank, world, "gpt", _cfg(3, allreduce), steps=2)["ledger"][1]}
    return out


@pytest.fixture(scope="module")
def ours():
    return zeroedu.launch(_zeroedu_runs, world_size=N, timeout=550)[0]


def _padded(numel: int) -> int:
    return -(-numel // N) * N


def test_bytes_are_the_closed_form_for_both_settings(ours):
    """fp32 (4 bytes an element). Key false: the paper's reduce-scatter; true: an all-reduce of each bucket. Stage
    2 reduces every micro-step, stage 1 once a step; the parameter all-gather is the same either way."""
    for (stage, allreduce, accum), r in ours.items():
        if stage == 3:
            continue
        psi = sum(_padded(k) for k in r["layout"])   # elements, padded to N per bucket
        ledger, times = r["ledger"], accum if stage == 2 else 1
        grads = Fraction(2 if allreduce else 1) * (N - 1) / N * 4 * psi * times
        op = "backward/all_reduce" if allreduce else "backward/reduce_scatter"
        assert ledger.get(op) == grads, (stage, allreduce, accum, ledger)
        assert ledger.get("backward/reduce_scatter" if allreduce else "backward/all_reduce", 0) == 0
        assert ledger["step/all_gather"] == Fraction(N - 1, N) * 4 * psi
        if accum == 1:   # a step: 3 (N-1)/N Psi elements with the key, 2 (N-1)/N Psi without
            total = sum(v for k, v in ledger.items() if k != "total")
            assert total == Fraction(3 if allreduce else 2) * (N - 1) / N * 4 * psi


def test_same_training_either_way_and_as_one_process(ours):
    ref_losses, _ = single_process("gpt", steps=3)
    for (stage, allreduce, accum), r in ours.items():
        if stage == 3:
            continue
        assert rel(r["losses"], ref_losses) < 1e-6, (stage, allreduce, accum)
        # An all-reduce then a slice and a reduce-scatter give each rank the same sum of two numbers: bit-equal.
        other = ours[stage, not allreduce, accum]["params"]
        assert all(torch.equal(r["params"][k], other[k]) for k in other), (stage, accum)


def test_stage_three_ignores_the_key(ours):
    assert ours[3, True, 1]["ledger"] == ours[3, False, 1]["ledger"]
    assert "backward/all_reduce" not in ours[3, True, 1]["ledger"]


def _deepspeed_and_zeroedu(rank: int, world: int) -> dict:
    """The same TinyGPT, bf16, stage 2, under real DeepSpeed at its defaults (key true) and with the key false,
    and under zeroedu with the key true and false: bytes of each collective in step 1 (DeepSpeed's comms logger,
    zeroedu's ledger), and DeepSpeed's grad accumulation dtype."""
    from deepspeed.comm import comm as ds_comm

    from zeroedu.graduate import import_deepspeed
    from zeroedu.models import shard_batch

    from reference import batch, loss_fn, make

    ds = import_deepspeed()
    out: dict = {"psi": sum(p.numel() for p in make("gpt").parameters())}
    for allreduce in (True, False):
        cfg = _cfg(2, allreduce, "bf16")
        cfg["optimizer"]["params"]["torch_adam"] = True   # no FusedAdam build on CPU
        cfg["zero_optimization"]["reduce_bucket_size"] = 500_000_000   # DeepSpeed's default: one bucket here
        cfg["comms_logger"] = {"enabled": True}
        for name, lib in (("deepspeed", ds), ("zeroedu", zeroedu)):
            engine, *_ = lib.initialize(model=make("gpt"), config=cfg)
            if name == "deepspeed":
                out["data_types"] = [str(t) for t in engine.get_data_types()]
            for s in range(2):
                ds_comm.comms_logger.comms_dict.clear()
                x, y = batch("gpt", s, 8)
                xs, ys = shard_batch(x, y, rank, world)
                engine.backward(loss_fn(engine(xs), ys))
                engine.step()
            if name == "deepspeed":
                out[name, allreduce] = {op: sum(int(size) * int(v[0]) for size, v in sizes.items() if int(size) > 64)
                                        for op, sizes in ds_comm.comms_logger.comms_dict.items()}
            else:
                sums: dict[str, int] = {}
                for e in engine.ledger.select(step=1):
                    if e.tensor_bytes > 64:
                        sums[e.op] = sums.get(e.op, 0) + e.tensor_bytes
                out[name, allreduce] = sums
    return out


def test_deepspeed_at_its_default_all_reduces_the_gradients_as_zeroedu_with_the_key():
    """bf16, 2 bytes an element. DeepSpeed at its defaults: an all-reduce of the whole gradient (Psi elements,
    sent twice over by the ring: 3 Psi a step with the all-gather), no reduce-scatter; with the key false: a
    reduce of each rank's part to its owner. zeroedu with the key: the same all-reduce, to within padding; and
    DeepSpeed accumulates bf16 gradients in bf16 unless data_types.grad_accum_dtype says otherwise (fact 2)."""
    pytest.importorskip("deepspeed")
    r = zeroedu.launch(_deepspeed_and_zeroedu, world_size=N, timeout=550)[0]
    psi, pad = r["psi"], 2 * 64 * N   # each library pads its flat buffers a little (zeroedu to N, DeepSpeed to 2N)
    theirs, mine = r["deepspeed", True], r["zeroedu", True]
    assert 0 <= theirs["all_reduce"] - 2 * psi <= pad, theirs
    assert 0 <= mine["all_reduce"] - 2 * psi <= pad, mine
    assert theirs.get("reduce_scatter", 0) == theirs.get("reduce", 0) == 0
    assert "reduce_scatter" not in mine
    paper, theirs_off = r["zeroedu", False], r["deepspeed", False]
    assert paper.get("all_reduce", 0) == 0 and 0 <= paper["reduce_scatter"] - 2 * psi <= pad
    # DeepSpeed with the key false reduces each rank's slice to its owner (torch.distributed.reduce): Psi
    # elements in all, the bytes of the paper's reduce-scatter, and no gradient all-reduce.
    assert theirs_off.get("all_reduce", 0) == 0 and 0 <= theirs_off["reduce"] - 2 * psi <= pad, theirs_off
    # The parameter all-gather, the same in all four: DeepSpeed's logger counts this rank's input, zeroedu the
    # gathered output (N times as much).
    for off in (True, False):
        assert r["zeroedu", off]["all_gather"] == N * r["deepspeed", off]["all_gather_into_tensor"]
    assert r["data_types"] == ["torch.bfloat16", "torch.bfloat16"]


def test_the_audited_estimates_are_deepspeeds_own_formulas():
    """Notebook 18 quotes DeepSpeed's estimators as 2 + 18/N (stage 2) and 4 x largest layer + 18/N (stage 3) bytes
    per parameter on the GPU without offload: called here on round numbers, next to those closed forms."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from zeroedu.course.estimators import estimates

    psi, largest, n = 7_000_000_000, 500_000_000, 8
    assert estimate_zero2_model_states_mem_needs(psi, n, cpu_offload=False)[1] == 2 * psi + 18 * psi // n
    assert estimate_zero3_model_states_mem_needs(psi, largest, n, cpu_offload=False,
                                                 cpu_offload_params=False)[1] == 4 * largest + 18 * psi // n
    est = estimates(psi, largest, n)
    assert est["DeepSpeed estimate_zero*_model_states_mem_needs"] == {2: 2 * psi + 18 * psi // n,
                                                                     3: 4 * largest + 18 * psi // n}
    assert est["16 bytes per parameter"][2] == 16 * psi
    assert est["zeroedu.theory (the paper's 2 + 14/N, 16/N)"][3] == pytest.approx(16 * psi / n)


def test_a_bf16_weight_without_master_loses_updates_below_half_its_spacing():
    """Casebook case 10: next to 1.0, bf16's spacing below is 2**-8, so an Adam update of about 1e-3 (below half of
    it) rounds back to 1.0 at every step; through an fp32 master two updates add up past 2**-9 and the copy moves
    to 1 - 2**-8."""
    from zeroedu.course.casebook import masters_and_lr

    moves = masters_and_lr(steps=3, lr=1e-3)
    assert moves[False] == [1.0, 1.0, 1.0]
    assert moves[True][0] == 1.0 and moves[True][1] == 1 - 2 ** -8
