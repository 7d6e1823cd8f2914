"""zeroedu's ring collectives against gloo's own, and the ledger's byte counts against the ring formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeroedu

pytestmark = pytest.mark.timeout(300)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 12, 1001)   # odd sizes; reduce-scatter / all-gather use size x N


def compare(rank: int, world: int) -> list[tuple]:
    from zeroedu.comm import Comm

    ring = Comm(implementation="ring")
    native = Comm(implementation="native")
    problems = []
    for dtype in DTYPES:
        for size in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + size)
            # Small integers: sums are exact in every dtype, so ring and gloo must agree bit for bit.
            x = torch.randint(-8, 8, (size * world,), generator=g).to(dtype)
            a, b = x.clone(), x.clone()
            ring.all_reduce(a, average=False)
            native.all_reduce(b, average=False)
            ref = x.clone()
            dist.all_reduce(ref)
            if not (torch.equal(a, ref) and torch.equal(b, ref)):
                problems.append(("all_reduce", dtype, size))
            out_r = torch.empty(size, dtype=dtype)
            out_n = torch.empty(size, dtype=dtype)
            ring.reduce_scatter(out_r, x.clone(), average=False)
            native.reduce_scatter(out_n, x.clone(), average=False)
            if not (torch.equal(out_r, ref.chunk(world)[rank]) and torch.equal(out_n, out_r)):
                problems.append(("reduce_scatter", dtype, size))
            piece = x[:size].clone()
            full_r = torch.empty(size * world, dtype=dtype)
            full_n = torch.empty(size * world, dtype=dtype)
            ring.all_gather(full_r, piece)
            native.all_gather(full_n, piece)
            parts = [torch.empty(size, dtype=dtype) for _ in range(world)]
            dist.all_gather(parts, piece)
            if not (torch.equal(full_r, torch.cat(parts)) and torch.equal(full_n, full_r)):
                problems.append(("all_gather", dtype, size))
    # Coalesced: several tensors of different sizes in one collective give what one collective each gives.
    for comm in (ring, native):
        sizes = (3, 1, 8)
        ins = [torch.randint(-8, 8, (k * world,), generator=torch.Generator().manual_seed(rank * 10 + k)).float()
               for k in sizes]
        outs = [torch.empty(k) for k in sizes]
        before = len(comm.ledger)
        comm.reduce_scatter_coalesced(outs, [t.clone() for t in ins], average=False)
        for t, out in zip(ins, outs, strict=True):
            ref = t.clone()
            dist.all_reduce(ref)
            if not torch.equal(out, ref.chunk(world)[rank]):
                problems.append(("reduce_scatter_coalesced", comm.implementation, out.numel()))
        gathered = [torch.empty(k * world) for k in sizes]
        comm.all_gather_coalesced(gathered, outs)
        for out, full in zip(outs, gathered, strict=True):
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out)
            if not torch.equal(full, torch.cat(parts)):
                problems.append(("all_gather_coalesced", comm.implementation, out.numel()))
        entries = comm.ledger[before:]
        if [(e.op, e.tensor_bytes) for e in entries] != [("reduce_scatter", 4 * world * sum(sizes)),
                                                          ("all_gather", 4 * world * sum(sizes))]:
            problems.append(("coalesced ledger", [(e.op, e.tensor_bytes) for e in entries]))
    # Averaging divides by N after the sum.
    t = torch.full((5,), float(rank))
    ring.all_reduce(t, average=True)
    if not torch.allclose(t, torch.full((5,), (world - 1) / 2)):
        problems.append(("average", t.tolist()))
    return [problems, [(e.op, e.impl, e.tensor_bytes, e.sent_bytes, e.sent_measured, e.group_size, e.numel)
                       for e in ring.ledger]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_equals_gloo(world):
    results = zeroedu.launch(compare, world_size=world, timeout=200)
    for problems, _ in results:
        assert problems == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_sent_bytes_are_measured_and_match_formula(world):
    """The ring counts the payloads it hands to isend; for sizes divisible by N that is exactly the formula."""
    _, ledger = zeroedu.launch(compare, world_size=world, timeout=200)[0]
    seen = 0
    for op, impl, tensor_bytes, sent, measured, n, numel in ledger:
        if impl != "ring" or op not in {"all_reduce", "reduce_scatter", "all_gather"}:
            continue
        assert measured and n == world
        steps = 2 * (world - 1) if op == "all_reduce" else world - 1
        if numel % world == 0:
            assert sent == steps * tensor_bytes // world, (op, tensor_bytes, sent)
            seen += 1
    assert seen > 20


def test_world_of_one_sends_nothing():
    _, ledger = zeroedu.launch(compare, world_size=1, timeout=120)[0]
    assert all(entry[3] == 0 for entry in ledger)


def _subgroup(rank: int, world: int):
    from zeroedu.comm import Comm

    comm = Comm(implementation="ring")   # the ring pads and counts what it sends
    pair = [comm.subgroup([0, 1]), comm.subgroup([2, 3])][rank // 2]
    t = torch.tensor([float(rank)])
    pair.all_reduce(t, average=False)
    return float(t), [(e.group, e.sent_bytes) for e in comm.ledger]


def test_subgroups_share_the_ledger_and_record_their_ranks():
    results = zeroedu.launch(_subgroup, world_size=4, timeout=120)
    assert [r[0] for r in results] == [1.0, 1.0, 5.0, 5.0]
    # A 1-element tensor on 2 ranks: padded to 2 elements, each rank sends 1 element twice = 8 bytes.
    assert results[0][1] == [((0, 1), 8)] and results[3][1] == [((2, 3), 8)]
