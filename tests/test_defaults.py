"""Buffer sizes when the config names none (zeroedu.stages.sizing), and what they give: memory per rank that
falls from stage 0 to 3, with peaks next to FSDP2's, measured by torch's own MemTracker on real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

import zeroedu
from zeroedu.config import load_config

pytestmark = pytest.mark.timeout(600)

WIDTH, LAYERS = 512, 8   # the benchmark's MLP, half as wide: Psi = 8 x (512 x 512 + 512) + (512 x 10 + 10)


def _psi_and_layer() -> tuple[int, int]:
    layer = WIDTH * WIDTH + WIDTH
    return LAYERS * layer + WIDTH * 10 + 10, layer


def test_a_size_left_out_is_automatic_and_one_given_is_kept():
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.reduce_bucket_size is None
    z = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": None,
                                           "stage3_prefetch_bucket_size": 5e8}}).zero_optimization
    assert z.reduce_bucket_size is None and z.stage3_prefetch_bucket_size == 500_000_000
    with pytest.raises(zeroedu.config.ConfigError, match="reduce_bucket_size"):
        load_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}})


def _sizes(rank: int, world: int) -> dict:
    from zeroedu.bench import bench_mlp

    out = {}
    for stage in (0, 1, 2, 3):
        for given in ({}, {"reduce_bucket_size": 270_000, "stage3_prefetch_bucket_size": 10,
                           "stage3_max_live_parameters": 7}):
            engine, *_ = zeroedu.initialize(model=bench_mlp(WIDTH, LAYERS),
                                            config={"zero_optimization": {"stage": stage, **given}})
            if stage >= 2:
                from zeroedu.models import mlp_loss

                x = torch.randn(4, WIDTH)
                engine.train_batch((x, torch.zeros(4, dtype=torch.long)), mlp_loss)
            out[stage, bool(given)] = {"bucket": engine.bucket_numel, "prefetch": getattr(engine, "prefetch_numel", 0),
                                       "high": getattr(engine, "bucket_bytes_high", 0),
                                       "held": engine.memory()["resident"].get("buckets", 0),
                                       "live": getattr(engine, "max_live", 0),
                                       "layout": [b.numel for b in engine.layout.buckets]}
    return out


def test_default_sizes_follow_the_model_and_explicit_ones_are_honoured():
    """Without sizes: stages 0-1 one bucket of up to 5e7 (the whole model here); stage 2 buckets of Psi / 8
    elements (this MLP: one layer); stage 3 a reduce bucket of the largest unit, a prefetch of Psi / 8 and at
    most twice that gathered. With sizes: exactly those, DeepSpeed's greedy buckets of at most
    reduce_bucket_size."""
    psi, layer = _psi_and_layer()
    r = zeroedu.launch(_sizes, world_size=2)[0]
    auto = math.ceil(psi / 8)
    assert layer <= auto < layer + WIDTH * 10 + 10   # one layer, and not one layer plus the head
    for stage in (0, 1):
        assert r[stage, False]["bucket"] == 50_000_000 and r[stage, False]["layout"] == [psi]
    assert r[2, False]["bucket"] == auto and r[2, False]["layout"] == [layer] * LAYERS + [WIDTH * 10 + 10]
    for stage in (2, 3):   # at most two bucket buffers at once during backward, none after it
        for given in (False, True):
            run = r[stage, given]   # fp32; a buffer: one bucket (padded to N = 2), at stage 3 up to bucket_numel
            assert 0 < run["high"] <= 2 * 4 * (max(run["bucket"], *run["layout"]) + 1) and run["held"] == 0, run
    assert r[3, False]["bucket"] == layer and r[3, False]["prefetch"] == auto and r[3, False]["live"] == 2 * auto
    for stage in (0, 1, 2):   # 270,000 elements: one layer (262,656) per bucket, the head (5,130) with the last
        assert r[stage, True]["bucket"] == 270_000
        assert r[stage, True]["layout"] == [layer] * (LAYERS - 1) + [layer + WIDTH * 10 + 10]
    assert r[3, True]["bucket"] == 270_000 and r[3, True]["prefetch"] == 10 and r[3, True]["live"] == 7


def test_memory_falls_from_stage_0_to_3_at_the_defaults_with_peaks_near_fsdp2():
    """The benchmark's harness at the defaults: resident and peak bytes of every live tensor per rank (torch's
    MemTracker, the same tracker for zeroedu and torch's peers) fall from stage to stage, stage 2 and 3 peaks
    are at most 1.1x FSDP2's (reshard_after_forward False and True), and no bucket buffer outlives a step."""
    from zeroedu import bench
    from zeroedu.comm import agreement

    rows = bench.run(world_size=2, d_model=WIDTH, layers=LAYERS, rounds=1, warmup=1, micro_batch=8,
                     workload="mlp", defaults=True)
    resident = [r["zeroedu_resident"] for r in rows]
    peak = [r["zeroedu_peak"] for r in rows]
    assert resident == sorted(resident, reverse=True) and len(set(resident)) == 4, resident
    assert peak == sorted(peak, reverse=True) and len(set(peak)) == 4, peak
    # between steps: the model states, Adam's step counters (a 4-byte scalar per piece), and the buffers of the
    # collective-agreement checks still in flight (each: this rank's payload and one from every rank)
    per_check = agreement.PAYLOAD_BYTES * (1 + 2)
    for r in rows:
        extra = r["zeroedu_resident"] - r["zeroedu_states"]
        assert r["zeroedu_states"] == r["theory_states"] and 0 < extra % per_check < 100, r
        assert extra // per_check <= agreement.IN_FLIGHT, r
    for r in rows[2:]:
        assert r["zeroedu_peak"] <= 1.1 * r["peer_peak"], (r["stage"], r["zeroedu_peak"], r["peer_peak"])


def _reduce_scatters(rank: int, world: int) -> list[list[int]]:
    from zeroedu.models import shard_batch

    from reference import batch, loss_fn, make
    from workers import config

    engine, *_ = zeroedu.initialize(model=make("gpt"), config=config(3, bucket=3000, persist=200))
    for s in range(3):
        engine.train_batch(shard_batch(*batch("gpt", s, 8), rank, world), loss_fn)
    return [[e.numel for e in engine.ledger.select(step=s, op="reduce_scatter")] for s in range(3)]


def test_stage3_sends_a_full_bucket_early_into_the_same_buckets():
    """From the second backward on, stage 3 reduce-scatters a bucket as soon as the next unit (in the order the
    first backward recorded) would not fit, instead of when that unit arrives: the first backward, which
    cannot predict, must make the very same collectives of the very same sizes."""
    for per_step in zeroedu.launch(_reduce_scatters, world_size=2):
        assert len(per_step[0]) > 2 and per_step[0] == per_step[1] == per_step[2], per_step
