"""`stage3_max_reuse_distance`: stage 3 keeps the units the backward will use soon gathered from forward to backward.

Checked against three references: a single-process run (and the same bits at every distance), the closed form
(zeroedu.theory.reused_units and comm_bytes_per_step: which units stay, and the bytes each rank sends), and real
DeepSpeed at its default distance of 1e9, which gathers every parameter once a step.
"""

from __future__ import annotations

import pytest
import torch

import zeroedu
from zeroedu import theory
from zeroedu.models import MLP, mlp_batch, shard_batch

from reference import param_rel

pytestmark = pytest.mark.timeout(600)

SIZES = (32, 64, 64, 64, 10)          # units in forward order: 2112, 4160, 4160, 650 elements
UNITS = [a * b + b for a, b in zip(SIZES[:-1], SIZES[1:], strict=False)]
DISTANCES = (0, 1, 1400, 10_000, 1_000_000_000)
STEPS, BATCH, LR = 3, 8, 1e-3


def _config(distance: int, accum: int = 1) -> dict:
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "Adam", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": distance}}


def _train(rank: int, world: int, runs: list[tuple[int, int]]) -> dict:
    out = {}
    for distance, accum in runs:
        engine, *_ = zeroedu.initialize(model=MLP(SIZES, seed=0), config=_config(distance, accum))
        losses = []
        for s in range(STEPS):
            x, y = mlp_batch(s, BATCH, SIZES)
            for micro in range(accum):
                xs, ys = shard_batch(x, y, rank, world, micro, accum)
                loss = torch.nn.functional.cross_entropy(engine(xs), ys)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        with torch.no_grad():   # a forward without grad keeps nothing for a backward that will not come
            engine(mlp_batch(0, 2, SIZES)[0])
        out[(distance, accum)] = {
            "losses": losses, "params": engine.master_state_dict(),
            "ledger": [engine.ledger.per_step(s) for s in range(STEPS)],
            "reused": sorted(engine.layout.buckets[u].numel for u in engine.reused),
            "gathered_after_eval": len([u for u in engine.gathered if u not in engine.persistent]),
        }
    return out


def _single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = MLP(SIZES, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        x, y = mlp_batch(s, BATCH, SIZES)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def runs(request):
    n = request.param
    return n, zeroedu.launch(_train, world_size=n, args=([(d, 1) for d in DISTANCES] + [(1400, 2)],), timeout=500)


def test_the_closed_form_keeps_the_last_units():
    assert theory.reused_units(UNITS, 0) == []
    assert theory.reused_units(UNITS, 1) == [650]                 # nothing comes between the head and its backward
    assert theory.reused_units(UNITS, 1400) == [4160, 650]        # 2 x 650 = 1300 < 1400
    assert theory.reused_units(UNITS, 10_000) == [4160, 4160, 650]   # 2 x (4160 + 650) = 9620
    assert theory.reused_units(UNITS, 10_000, persistence_threshold=1000) == [4160, 4160]
    assert theory.reused_units(UNITS, 1_000_000_000) == UNITS


def test_reused_units_must_be_in_the_layout():
    with pytest.raises(ValueError, match="reused unit of 5 elements is not in the layout"):
        theory.comm_bytes_per_step(sum(UNITS), 2, 3, "fp32", layout=UNITS, reused=[5])
    with pytest.raises(ValueError, match="persistent and reused units exist only at stage 3"):
        theory.comm_bytes_per_step(sum(UNITS), 2, 2, "fp32", layout=UNITS, reused=[650])


def test_same_bits_as_the_single_process_run_at_every_distance(runs):
    n, results = runs
    ref_losses, ref_params = _single_process()
    base = results[0][(0, 1)]
    for key, r in results[0].items():
        assert param_rel(r["params"], ref_params) < 1e-6, key
        for name in ref_params:
            if key[1] == 1:   # keeping a unit changes no arithmetic
                assert torch.equal(r["params"][name], base["params"][name]), (key, name)
        if key[1] == 1:
            assert r["losses"] == base["losses"], key
    global_losses = [sum(rank[(0, 1)]["losses"][s] for rank in results) / n for s in range(STEPS)]
    assert global_losses == pytest.approx(ref_losses, rel=1e-6)


def test_kept_units_and_bytes_are_the_closed_forms(runs):
    n, results = runs
    for (distance, accum), r in results[0].items():
        kept = theory.reused_units(UNITS, distance)
        assert r["reused"] == sorted(kept), distance
        want = theory.comm_bytes_per_step(sum(UNITS), n, 3, "fp32", grad_accum=accum, layout=UNITS,
                                          reused=kept or None)
        want = {k: v for k, v in want.items() if v and k != "total"}
        for s in range(STEPS):   # the first step too: what is kept is known when the first forward ends
            got = {k: v for k, v in r["ledger"][s].items() if v and k not in ("total", "init/broadcast")}
            assert got == want, (distance, accum, s, got, want)
        assert r["gathered_after_eval"] == 0, distance
    # At 1e9 every unit is gathered once a step: the backward gathers nothing.
    assert "backward/all_gather" not in {k for k, v in results[0][(1_000_000_000, 1)]["ledger"][1].items() if v}


def _deepspeed_gathers(rank: int, world: int) -> list[int]:
    """Real DeepSpeed, stage 3 at its default stage3_max_reuse_distance (1e9): bytes its all-gathers logged per
    step for the units that are released between steps (not the persistent ones, gathered after the step)."""
    from deepspeed.comm import comm as ds_comm

    from zeroedu.graduate import import_deepspeed

    ds = import_deepspeed()
    cfg = {"train_batch_size": BATCH, "comms_logger": {"enabled": True},
           "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": max(UNITS), "stage3_max_live_parameters": 10 ** 9}}
    engine, *_ = ds.initialize(model=MLP(SIZES, seed=0), config=cfg)
    per_step = []
    for s in range(STEPS):
        ds_comm.comms_logger.comms_dict.clear()
        x, y = mlp_batch(s, BATCH, SIZES)
        xs, ys = shard_batch(x, y, rank, world)
        engine.backward(torch.nn.functional.cross_entropy(engine(xs), ys))
        engine.step()
        sizes = ds_comm.comms_logger.comms_dict.get("all_gather_into_tensor", {})
        per_step.append(sum(int(size) * int(vals[0]) for size, vals in sizes.items()))
    return per_step


def test_deepspeed_at_its_default_distance_gathers_each_parameter_once_a_step():
    """DeepSpeed records its trace in the first step, releasing every unit after each use: each is gathered twice.
    From then on, at its default distance, once. zeroedu with the same distance: the same halving."""
    pytest.importorskip("deepspeed")
    theirs = zeroedu.launch(_deepspeed_gathers, world_size=2, timeout=500)[0]
    assert theirs[1] == theirs[2] and 2 * theirs[1] == theirs[0], theirs
    ours = zeroedu.launch(_train, world_size=2, args=([(0, 1), (1_000_000_000, 1)],), timeout=500)[0]
    twice = sum(v for k, v in ours[(0, 1)]["ledger"][1].items() if k.endswith("all_gather"))
    once = sum(v for k, v in ours[(1_000_000_000, 1)]["ledger"][1].items() if k.endswith("all_gather"))
    assert 2 * once == twice
