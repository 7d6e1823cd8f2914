"""zeroedu.zero (Init, GatheredParameters), engine.save_16bit_model, on real gloo ranks.

References, none taken from the code under test: the same model built without Init and trained at stage 3
(bit for bit: Init draws the same random numbers and the engine takes the same per-module units); the closed
form of the construction peak (the pieces kept so far + the module being built + its piece), written out from
the model's layer sizes (and Init's 8-byte fingerprints); the values written on one rank, read back on
every rank and from the fp32 master weights; a plain nn.Module loading the saved file.
"""

from __future__ import annotations

import os

import pytest
import torch
from zero_r_workers import capped_run, gathered_run, init_run, save16_run

import zeroedu
from zeroedu.models import MLP, TinyGPT, gpt_batch

pytestmark = pytest.mark.timeout(300)
SIZES = (32, 96, 96, 96, 96, 96, 96, 10)    # 7 Linear layers, the largest 96 x 96 + 96


def linear_numels(sizes):
    return [a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False)]


def test_init_peak_and_training_equal_the_model_built_whole():
    world = 2
    res = zeroedu.launch(init_run, world_size=world, args=(SIZES, True))
    ref = zeroedu.launch(init_run, world_size=world, args=(SIZES, False))
    numels = linear_numels(SIZES)
    pieces = [4 * -(-n // world) for n in numels]              # fp32, each module padded to a multiple of N
    check = 8 * 2 * (1 + world)    # Init's fingerprints: an fp64 per parameter (weight, bias), all-gathered
    want_peak = max(sum(pieces[:k]) + 4 * n + pieces[k] for k, n in enumerate(numels)) + check
    for r in range(world):
        assert ref[r]["peak"] == 4 * sum(numels)                # built whole: the whole model at once
        assert res[r]["peak"] == want_peak
        assert res[r]["peak"] <= sum(pieces) + 4 * max(numels) + check   # shard + largest module
        assert res[r]["empty"] == [0] * len(ref[r]["empty"])    # no rank holds a parameter after Init
        assert res[r]["losses"] == ref[r]["losses"]
        assert all(torch.equal(res[r]["params"][k], v) for k, v in ref[r]["params"].items())


def test_a_model_over_the_memory_cap_builds_and_trains_inside_init_only():
    """A per-rank cap of 9/10 of the model's fp32 bytes: building it whole hits the cap; inside Init on 4 ranks
    it is built and trained at stage 3 (SGD: 8 bytes per parameter / 4 ranks, plus a few of the 25 units in
    buckets, gathered and as full gradients)."""
    sizes = (32,) + (64,) * 24 + (10,)
    full = 4 * sum(linear_numels(sizes))
    cap = 9 * full // 10
    whole = zeroedu.launch(capped_run, world_size=4, args=(sizes, cap, False))
    inside = zeroedu.launch(capped_run, world_size=4, args=(sizes, cap, True))
    for r in range(4):
        assert not whole[r]["ok"] and "over this rank's cap" in whole[r]["error"]
        assert inside[r]["ok"] and inside[r]["peak"] <= cap and inside[r]["train_peak"] <= cap, inside[r]


def test_gathered_parameters_read_modify_and_ledger():
    world = 2
    res = zeroedu.launch(gathered_run, world_size=world)
    a, b = res
    # Init's pieces: rank 0's init and rank 1's copy reached every rank
    torch.manual_seed(123)
    want_first = torch.nn.init.normal_(torch.empty(16, 8), std=0.5)
    for r in res:
        assert r["init_empty"]
        assert torch.equal(r["init_full"]["layers.0.weight"], want_first)
        assert torch.equal(r["init_full"]["layers.2.weight"], r["init_full"]["layers.1.weight"][:4])
    assert all(torch.equal(a["init_full"][k], v) for k, v in b["init_full"].items())
    # a stage-3 engine: the embedding read whole, empty again after; ln_f written by rank 1
    ref = TinyGPT()
    for r in res:
        assert r["wte_empty_before"] == 0 and r["wte_empty_after"] == 0
        assert torch.equal(r["wte"], ref.wte.weight.detach())
        assert torch.equal(r["master"]["ln_f.weight"], torch.full((64,), 0.5))      # in the fp32 master weights
        assert torch.equal(r["master"]["ln_f.bias"], torch.zeros(64))
    padded, piece = a["ln_f_unit"]
    assert padded == 128 and piece == 64                                           # ln_f: 64 + 64 values
    assert torch.equal(a["ln_f_piece"], torch.full((64,), 0.5)) and torch.equal(b["ln_f_piece"], torch.zeros(64))
    # the ledger: one all-gather of wte (128 x 64 fp32), one of ln_f and the broadcast that wrote it back
    wte_bytes = 4 * 128 * 64
    assert a["gathers"] == [("all_gather", "params", wte_bytes, wte_bytes // 2),
                            ("all_gather", "params", 4 * padded, 4 * padded // 2),
                            ("broadcast", "params", 4 * padded, a["gathers"][2][3])]
    for r in (a, b):   # ZeRO++ and offload keep copies that a broadcast into the shard would leave stale
        assert [name for name, _ in r["refused"]] == ["Stage3ZeroPP", "Stage3Offload"], r["refused"]
        assert all("changes weights of a plain stage-3 engine only" in msg for _, msg in r["refused"])


@pytest.mark.parametrize("stage", [0, 3])
def test_save_16bit_model_loads_into_a_plain_module(tmp_path, stage):
    path = str(tmp_path / f"s{stage}")
    res = zeroedu.launch(save16_run, world_size=2, args=(stage, path, True))
    assert all(r["saved"] for r in res)
    state = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    plain = TinyGPT().to(torch.bfloat16)
    plain.load_state_dict(state)           # strict: every key of a plain TinyGPT, and nothing else
    assert all(v.dtype == torch.bfloat16 for k, v in state.items() if k != "blocks.0.attn.mask" and
               v.is_floating_point())
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), res[0]["master"][name].to(torch.bfloat16)), name
    assert plain.head.weight is plain.wte.weight
    plain(gpt_batch(0, 2)[0])              # and it runs


def test_save_16bit_model_at_stage_3_needs_the_flag(tmp_path):
    res = zeroedu.launch(save16_run, world_size=2, args=(3, str(tmp_path / "none"), False))
    assert not any(r["saved"] for r in res) and not (tmp_path / "none").exists()


def test_init_model_needs_stage_3():
    def run(rank, world):
        from zeroedu import zero

        with zero.Init(config={"zero_optimization": {"stage": 3}}):
            model = MLP((4, 8, 2))
        try:
            zeroedu.initialize(model=model, config={"zero_optimization": {"stage": 2}})
        except ValueError as e:
            return str(e)
        return "no error"

    msg = zeroedu.launch(run, world_size=2)[0]
    assert "built inside zeroedu.zero.Init" in msg and "stage 3" in msg


def test_init_refuses_ranks_that_built_different_values():
    def run(rank, world):
        from zeroedu import zero

        try:
            with zero.Init():
                torch.manual_seed(rank)          # a different random state on each rank
                torch.nn.Linear(4, 4)
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert all("Seed the construction the same" in m for m in zeroedu.launch(run, world_size=2))
