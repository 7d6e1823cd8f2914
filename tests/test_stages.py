"""Every stage against a single-process run on the global batch, torch's own peers, and the theory.

Ranks are real processes talking over real gloo. Starting ranks is the slow part on two cores, so each
world size starts once and trains every configuration inside (tests/workers.py).
"""

from __future__ import annotations

import pytest
import torch

import zeroedu
from zeroedu import theory
from zeroedu.models import TinyGPT

from reference import param_rel, rel, single_process

pytestmark = pytest.mark.timeout(600)

STAGES = (0, 1, 2, 3)


def runs_for(world: int) -> list[tuple]:
    from workers import config

    runs = [((s, "fp32"), "gpt", config(s)) for s in STAGES]
    if world > 1:
        runs += [((s, "quirky"), "quirky", config(s, accum=2, clip=0.05, bucket=60, micro=1)) for s in (2, 3)]
        runs += [((s, "bf16"), "gpt", config(s, "bf16")) for s in STAGES]
        runs += [((s, "fp16"), "gpt", config(s, "fp16")) for s in (0, 3)]
        runs += [((s, "accum"), "gpt", config(s, accum=2, micro=1)) for s in STAGES]
        runs += [((3, "persist"), "gpt", config(3, persist=200))]
        # Prefetch and live-parameter budgets below the model size, so stage 3 never holds it all at once.
        runs += [((s, "peak"), "gpt", config(s, micro=1, stage3_prefetch_bucket_size=10_000,
                                              stage3_max_live_parameters=20_000), 3, world, 2) for s in (2, 3)]
    return runs


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"N{n}")
def world(request):
    from workers import many

    n = request.param
    results = zeroedu.launch(many, world_size=n, args=(runs_for(n),), timeout=500)
    return n, results


def test_fp32_matches_single_process(world):
    n, results = world
    ref_losses, ref_params = single_process("gpt")
    for s in STAGES:
        r = results[0][(s, "fp32")]
        assert rel(r["losses"], ref_losses) < 1e-6, (s, r["losses"], ref_losses)
        assert param_rel(r["params"], ref_params) < 1e-6, s
        for other in results[1:]:  # every rank holds the same model afterwards
            assert param_rel(other[(s, "fp32")]["params"], r["params"]) == 0.0


def test_accumulation_matches_single_process(world):
    n, results = world
    if n == 1:
        pytest.skip("accumulation runs at N >= 2")
    ref_losses, ref_params = single_process("gpt")
    for s in STAGES:
        r = results[0][(s, "accum")]
        assert rel(r["losses"], ref_losses) < 1e-6, s
        assert param_rel(r["params"], ref_params) < 1e-6, s


def test_awkward_model(world):
    """Tied weight, a layer used twice, an unused parameter, odd counts, clipping, accumulation."""
    n, results = world
    if n == 1:
        pytest.skip("runs at N >= 2")
    ref_losses, ref_params = single_process("quirky", clip=0.05)
    for s in (2, 3):
        r = results[0][(s, "quirky")]
        assert rel(r["losses"], ref_losses) < 1e-6, (s, r["losses"], ref_losses)
        assert param_rel(r["params"], ref_params) < 1e-6, s
    assert sum(p.numel() for p in ref_params.values()) % n != 0  # the padding path really ran


@pytest.mark.parametrize("precision,tol", [("bf16", 2e-2), ("fp16", 2e-3)])
def test_mixed_precision_tracks_reference(world, precision, tol):
    """16-bit runs reduce in 16 bits across ranks, so they track, not equal, the single-process 16-bit run:
    losses within `tol` relative, weights within 10 x tol."""
    n, results = world
    if n == 1:
        pytest.skip("runs at N >= 2")
    ref_losses, ref_params = single_process("gpt", precision=precision, scale=2.0 ** 8 if precision == "fp16"
                                            else 1.0)
    for (s, kind), r in results[0].items():
        if kind == precision:
            assert rel(r["losses"], ref_losses) < tol, (s, r["losses"], ref_losses)
            assert param_rel(r["params"], ref_params) < 10 * tol, s


def test_ledger_equals_theory(world):
    n, results = world
    precisions = {"fp32": "fp32", "bf16": "bf16", "accum": "fp32", "persist": "fp32"}
    for (s, kind), r in results[0].items():
        if kind not in precisions:
            continue
        accum = 2 if kind == "accum" else 1
        psi = sum(r["layout"])
        want = theory.comm_bytes_per_step(psi, n, s, precisions[kind], grad_accum=accum, layout=r["layout"],
                                          persistent=r["persistent"] or None)
        got = r["ledger"][1]
        want = {k: v for k, v in want.items() if v}
        got = {k: v for k, v in got.items() if v}
        assert got == want, (s, kind, got, want)
        assert r["scalars"] == 0   # no clipping, no fp16: nothing needs the global gradient norm
    # With clipping, one scalar all-reduce per step (the global norm) where the gradient is sharded.
    for (s, kind), r in results[0].items():
        if kind == "quirky":
            assert r["scalars"] == (1 if n > 1 else 0), (s, r["scalars"])


def test_ledger_layout_is_independent_of_engine(world):
    """The bucket sizes the theory is given come from the greedy rule, recomputed here from the model."""
    n, results = world
    sizes = [p.numel() for p in dict.fromkeys(TinyGPT(seed=0).parameters())]
    buckets: list[int] = []
    for k in sizes:
        if buckets and buckets[-1] + k <= 3000:
            buckets[-1] += k
        else:
            buckets.append(k)
    for s in (0, 1, 2):
        assert results[0][(s, "fp32")]["layout"] == buckets


def test_model_state_bytes_equal_theory(world):
    n, results = world
    for (s, kind), r in results[0].items():
        if kind not in {"fp32", "bf16"}:
            continue
        want = theory.model_state_bytes(sum(r["layout"]), n, s, kind, "adam", layout=r["layout"])
        got = r["memory"]["resident"]
        for cat in ("parameters", "gradients", "master_weights", "optimizer_state"):
            assert got.get(cat, 0) == want[cat], (s, kind, cat, got, want)


def test_stage3_peak_below_stage2(world):
    n, results = world
    if n < 4:
        pytest.skip("sharding pays off visibly at N = 4")
    p2 = results[0][(2, "peak")]["memory"]
    p3 = results[0][(3, "peak")]["memory"]
    assert p3["peak_total"] < p2["peak_total"], (p3["peak"], p2["peak"])
    assert p3["peak"].get("gathered_parameters", 0) > 0   # the tracker saw the gathers


def test_fp16_overflow_skips_on_every_rank():
    """A loss scale of 2^40 overflows fp16: the step is skipped and the scale halves, on every rank."""
    from workers import config, train

    cfg = config(2, "fp16", scale_power=40, hysteresis=1)
    results = zeroedu.launch(train, world_size=2, args=("gpt", cfg, 3), timeout=120)
    for r in results:
        assert r["skipped"] == r["skip_entries"] >= 1
        assert r["scale"] == results[0]["scale"] < 2.0 ** 40
    k = results[0]["skipped"]   # hysteresis 1: every overflow halves the scale, and 3 steps are too few to grow it
    assert results[0]["scale"] == 2.0 ** (40 - k)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_matches_torch_ddp_and_zero_redundancy_optimizer(n):
    from workers import config, many, torch_peer

    def both(rank, world):
        return {"ddp": torch_peer(rank, world, "ddp"), "zro": torch_peer(rank, world, "zro"),
                **many(rank, world, [((0,), "gpt", config(0)), ((1,), "gpt", config(1))])}

    r = zeroedu.launch(both, world_size=n, timeout=300)[0]
    assert rel(r[(0,)]["losses"], r["ddp"]["losses"]) < 1e-6
    assert param_rel(r[(0,)]["params"], r["ddp"]["params"]) < 1e-6
    assert rel(r[(1,)]["losses"], r["zro"]["losses"]) < 1e-6
    assert param_rel(r[(1,)]["params"], r["zro"]["params"]) < 1e-6


def test_world_of_one_without_launch():
    """initialize() outside any launcher makes this process a world of one."""
    import subprocess
    import sys

    code = ("import zeroedu, torch; from zeroedu.models import TinyGPT, gpt_batch, gpt_loss;"
            "e,*_=zeroedu.initialize(model=TinyGPT(), config={'zero_optimization': {'stage': 3}});"
            "x,y=gpt_batch(0,2); l=gpt_loss(e(x),y); e.backward(l); e.step(); print('ok', e.world_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("ok 1"), out.stderr[-2000:]


def test_stage3_coalescing_changes_the_collectives_not_the_result():
    """Stage 3 gathers and reduces several units per collective; one collective per unit (coalesce = False)
    must train to the same bits and send the same bytes, in more collectives."""
    from workers import config

    def both(rank, world):
        import torch.distributed as dist

        from zeroedu.config import load_config
        from zeroedu.models import shard_batch
        from zeroedu.stages import Stage3

        from reference import batch, loss_fn, make

        out = {}
        for coalesce in (True, False):
            # DeepSpeed's prefetch (5e7) and live limit (1e9): the forward's units start gathering together.
            cfg = load_config(config(3, accum=2, micro=1, persist=200, stage3_prefetch_bucket_size=50_000_000,
                                     stage3_max_live_parameters=1_000_000_000))
            engine = type("Stage3Under", (Stage3,), {"coalesce": coalesce})(make("gpt"), cfg)
            losses = []
            for s in range(3):
                x, y = batch("gpt", s, 8)
                for micro in range(2):
                    xs, ys = shard_batch(x, y, rank, world, micro, 2)
                    loss = loss_fn(engine(xs), ys)
                    engine.backward(loss)
                    engine.step()
                    losses.append(float(loss))
            moved = [e for e in engine.ledger.select(step=1) if e.kind in ("params", "grads")]
            out[coalesce] = {"losses": losses, "params": engine.master_state_dict(),
                             "bytes": engine.ledger.per_step(1), "collectives": len(moved),
                             "units": len(engine.layout.buckets)}
            dist.barrier()
        return out

    for r in zeroedu.launch(both, world_size=2, timeout=300):
        one, each = r[True], r[False]
        assert one["losses"] == each["losses"]
        assert all(torch.equal(one["params"][k], each["params"][k]) for k in each["params"])
        assert one["bytes"] == each["bytes"]
        assert each["collectives"] >= 2 * one["collectives"], (one["collectives"], each["collectives"])


def test_stage3_backward_reduces_and_gathers_in_shared_rounds_with_the_same_result():
    """In backward, a bucket's reduce-scatter and the next gather go in one round of transfers (Comm.together):
    the same bits and the same ledger entries as one round each (fuse_backward = False), in fewer rounds."""
    from workers import config

    def both(rank, world):
        import torch.distributed as dist

        from zeroedu.config import load_config
        from zeroedu.stages import Stage3

        from reference import make
        from workers import run_steps

        out = {}
        for fuse in (True, False):
            cfg = load_config(config(3, accum=2, micro=1, persist=200))
            engine = type("Stage3Fused", (Stage3,), {"fuse_backward": fuse})(make("gpt"), cfg)
            rounds, before = engine.comm.rounds, len(engine.ledger)
            losses = run_steps(engine, "gpt", rank, world, 3)   # 3 steps of 2 micro-steps
            entries = [e for e in engine.ledger if e.kind in ("params", "grads")]
            out[fuse] = {"losses": losses, "params": engine.master_state_dict(), "fusing": engine.fusing(),
                         "entries": sorted((e.step, e.op, e.phase, e.kind, e.tensor_bytes, e.sent_bytes)
                                           for e in entries),
                         "rounds": engine.comm.rounds - rounds, "all": len(engine.ledger) - before}
            dist.barrier()
        return out

    for world in (2, 4):
        for r in zeroedu.launch(both, world_size=world, timeout=300):
            fused, apart = r[True], r[False]
            assert fused["fusing"] and not apart["fusing"]
            assert fused["losses"] == apart["losses"]
            assert all(torch.equal(fused["params"][k], apart["params"][k]) for k in apart["params"])
            assert fused["entries"] == apart["entries"]
            assert apart["rounds"] == apart["all"]   # one round per collective
            # every backward of the 6 micro-steps shared at least one round
            shared = apart["rounds"] - fused["rounds"]
            assert 6 <= shared <= sum(1 for e in fused["entries"] if e[1] == "reduce_scatter"), shared
