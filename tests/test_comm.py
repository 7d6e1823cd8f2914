"""zeroedu's ring and direct collectives against gloo's own, and the ledger's byte counts against the formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeroedu

pytestmark = pytest.mark.timeout(300)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 7, 12, 1001)   # odd sizes; reduce-scatter / all-gather use size x N


IMPLS = ("ring", "direct", "native", "auto")


def compare(rank: int, world: int) -> list[tuple]:
    """Every implementation against gloo's own collectives called directly, on small integers: sums are exact
    in every dtype, so they must agree bit for bit."""
    from zeroedu.comm import Comm

    comms = {impl: Comm(implementation=impl) for impl in IMPLS}
    ring, native = comms["ring"], comms["native"]
    problems = []
    for dtype in DTYPES:
        for size in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + size)
            x = torch.randint(-8, 8, (size * world,), generator=g).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            piece = x[:size].clone()
            parts = [torch.empty(size, dtype=dtype) for _ in range(world)]
            dist.all_gather(parts, piece)
            for impl, comm in comms.items():
                a = x.clone()
                comm.all_reduce(a, average=False)
                if not torch.equal(a, ref):
                    problems.append(("all_reduce", impl, dtype, size))
                out = torch.empty(size, dtype=dtype)
                comm.reduce_scatter(out, x.clone(), average=False)
                if not torch.equal(out, ref.chunk(world)[rank]):
                    problems.append(("reduce_scatter", impl, dtype, size))
                full = torch.empty(size * world, dtype=dtype)
                comm.all_gather(full, piece)
                if not torch.equal(full, torch.cat(parts)):
                    problems.append(("all_gather", impl, dtype, size))
    # On random values the order of the additions shows: direct adds in the ring's order, to the same bits.
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1000 * world, generator=torch.Generator().manual_seed(rank)).to(dtype)
        a, b = torch.empty(1000, dtype=dtype), torch.empty(1000, dtype=dtype)
        ring.reduce_scatter(a, x.clone())
        comms["direct"].reduce_scatter(b, x.clone())
        if not torch.equal(a, b):
            problems.append(("direct vs ring bits", dtype))
    # Coalesced: several tensors of different sizes in one collective give what one collective each gives.
    for comm in (ring, comms["direct"], native):
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
    # A non-contiguous tensor (a transposed matrix) gets its result too, through the padded copy.
    for impl in ("ring", "direct"):
        g = torch.Generator().manual_seed(rank)
        t = torch.randint(-8, 8, (3, world + 1), generator=g).float().t()
        ref = t.contiguous()
        dist.all_reduce(ref)
        Comm(implementation=impl).all_reduce(t, average=False)
        if not torch.equal(t, ref):
            problems.append(("non-contiguous all_reduce", impl))
    # Averaging divides by N after the sum.
    t = torch.full((5,), float(rank))
    ring.all_reduce(t, average=True)
    if not torch.allclose(t, torch.full((5,), (world - 1) / 2)):
        problems.append(("average", t.tolist()))
    return [problems, [(e.op, e.impl, e.tensor_bytes, e.sent_bytes, e.sent_measured, e.group_size, e.numel)
                       for c in (ring, comms["direct"]) for e in c.ledger],
            [(e.op, e.impl, e.sent_measured) for e in comms["auto"].ledger]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_equals_gloo(world):
    results = zeroedu.launch(compare, world_size=world, timeout=200)
    for problems, *_ in results:
        assert problems == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_sent_bytes_are_measured_and_match_formula(world):
    """The ring counts the payloads it hands to isend; for sizes divisible by N that is exactly the formula."""
    _, ledger, _ = zeroedu.launch(compare, world_size=world, timeout=200)[0]
    seen = {"ring": 0, "direct": 0}
    for op, impl, tensor_bytes, sent, measured, n, numel in ledger:
        if impl == "native" or op not in {"all_reduce", "reduce_scatter", "all_gather"}:
            continue
        assert measured and n == world
        steps = 2 * (world - 1) if op == "all_reduce" else world - 1
        if numel % world == 0:   # ring and direct: N-1 pieces of S/N per rank and phase
            assert sent == steps * tensor_bytes // world, (op, impl, tensor_bytes, sent)
            seen[impl] += 1
    assert min(seen.values()) > 20, seen


def test_auto_counts_its_bytes_on_gloo():
    """On gloo, "auto" runs gloo's own all-reduce, and a reduce-scatter and all-gather that count their sends."""
    *_, auto = zeroedu.launch(compare, world_size=2, timeout=200)[0]
    assert {impl for op, impl, _ in auto if op == "all_reduce"} == {"native"}
    assert all(measured and impl != "native" for op, impl, measured in auto if op != "all_reduce")
    assert {op for op, *_ in auto} == {"all_reduce", "reduce_scatter", "all_gather"}


def test_world_of_one_sends_nothing():
    _, ledger, _ = zeroedu.launch(compare, world_size=1, timeout=120)[0]
    assert all(entry[3] == 0 for entry in ledger)


def _coalesced_in_place(rank: int, world: int) -> dict:
    """Coalesced collectives on random values, "direct" (nothing packed) against the ring (packed into one flat
    tensor): their bits, their ledger entries, and the bytes each allocates on the calling thread (torch's
    MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroedu.comm import Comm

    sizes = (1000, 37, 4096)
    g = torch.Generator().manual_seed(rank)
    ins = [torch.randn(k * world, generator=g) for k in sizes]
    pieces = [torch.randn(k, generator=g) for k in sizes]
    out: dict = {"packs_nothing": {}}
    for impl in ("ring", "direct"):
        comm = Comm(implementation=impl)
        out["packs_nothing"][impl] = (comm.packs_nothing("reduce_scatter"), comm.packs_nothing("all_gather"))
        reduced, gathered = [torch.empty(k) for k in sizes], [torch.empty(k * world) for k in sizes]
        inputs = [t.clone() for t in ins]
        extra = {}
        for op in ("reduce_scatter", "all_gather"):
            tracker = MemTracker()
            tracker.track_external(*reduced, *gathered, *inputs, *pieces)
            with tracker:
                before = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("current").values())
                if op == "reduce_scatter":
                    comm.reduce_scatter_coalesced(reduced, inputs)
                else:
                    comm.all_gather_coalesced(gathered, pieces)
            peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
            extra[op] = peak - before
        out[impl] = {"reduced": reduced, "gathered": gathered, "extra": extra,
                     "ledger": [(e.op, e.numel, e.tensor_bytes, e.sent_bytes) for e in comm.ledger]}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_direct_coalesced_collectives_pack_nothing_and_give_the_rings_bits(world):
    results = zeroedu.launch(_coalesced_in_place, world_size=world, timeout=200)
    total = 1000 + 37 + 4096
    for r in results:
        ring, direct = r["ring"], r["direct"]
        assert r["packs_nothing"] == {"ring": (False, False), "direct": (True, True)}
        for a, b in zip(ring["reduced"] + ring["gathered"], direct["reduced"] + direct["gathered"], strict=True):
            assert torch.equal(a, b)   # the same additions in the same order
        # One entry each, with the bytes of one collective over all three tensors: S = N x total elements.
        assert [e[:3] for e in direct["ledger"]] == [e[:3] for e in ring["ledger"]] == [
            ("reduce_scatter", world * total, 4 * world * total), ("all_gather", world * total, 4 * world * total)]
        assert [e[3] for e in direct["ledger"]] == [4 * (world - 1) * total] * 2   # N-1 pieces of S/N, sent
        # The ring packs N x total elements (plus its own piece); direct allocates nothing to gather and, to
        # reduce, only the parts of N-2 ranks that cannot land in the output (none at 2 ranks).
        assert ring["extra"]["reduce_scatter"] >= 4 * world * total
        assert ring["extra"]["all_gather"] >= 4 * world * total
        assert direct["extra"] == {"reduce_scatter": 4 * (world - 2) * total, "all_gather": 0}


def _together(rank: int, world: int) -> dict:
    """A coalesced reduce-scatter and all-gather run together (one round) and one after the other."""
    from zeroedu.comm import Comm

    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(k * world, generator=g) for k in (300, 7)]
    pieces = [torch.randn(k, generator=g) for k in (50, 9, 1)]
    out = {}
    for impl, how in (("direct", "together"), ("direct", "apart"), ("ring", "together")):
        comm = Comm(implementation=impl)
        reduced, gathered = [torch.empty(k) for k in (300, 7)], [torch.empty(k * world) for k in (50, 9, 1)]
        inputs = [t.clone() for t in grads]
        rounds = comm.rounds
        if how == "together":
            comm.together([("reduce_scatter", reduced, inputs, "grads", True),
                           ("all_gather", gathered, pieces, "params", False)])
        else:
            comm.reduce_scatter_coalesced(reduced, inputs, average=True)
            comm.all_gather_coalesced(gathered, pieces)
        out[impl, how] = {"results": reduced + gathered, "rounds": comm.rounds - rounds,
                          "ledger": [(e.op, e.kind, e.numel, e.tensor_bytes, e.sent_bytes) for e in comm.ledger]}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_together_is_one_round_with_each_collectives_bits_and_entry(world):
    for r in zeroedu.launch(_together, world_size=world, timeout=200):
        together, apart, ring = r["direct", "together"], r["direct", "apart"], r["ring", "together"]
        for a, b, c in zip(together["results"], apart["results"], ring["results"], strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert together["ledger"] == apart["ledger"] == ring["ledger"]
        assert [e[:2] for e in together["ledger"]] == [("reduce_scatter", "grads"), ("all_gather", "params")]
        assert together["ledger"][0][4] == 4 * (world - 1) * (300 + 7)   # N-1 pieces of S/N, each
        # one meeting for both where both pack nothing; the ring packs, so it runs them one after the other
        assert (together["rounds"], apart["rounds"], ring["rounds"]) == (1, 2, 2)


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


# -- a bounded ledger -------------------------------------------------------------------------------------------

def bounded_ledger_run(rank: int, world: int, steps: int) -> dict:
    """Two identical stage-3 runs: one ledger keeps every entry (the reference, summed here by hand), the other
    keeps 40 entries and 5 steps of aggregates."""
    from reference import make
    from workers import config, run_steps

    engines = []
    for keep in (None, 40):
        engine, *_ = zeroedu.initialize(model=make("quirky"), config=config(3, bucket=60))
        engine.ledger.max_entries, engine.ledger.max_steps = keep, (None if keep is None else 5)
        run_steps(engine, "quirky", rank, world, steps)
        engines.append(engine)
    full, bounded = (e.ledger for e in engines)
    try:
        bounded.per_step(0)
        old = None
    except KeyError as e:
        old = str(e)
    return {"full": full, "bounded": bounded, "old_step": old}


def by_hand(entries, step=None, kinds=("params", "grads")) -> dict:
    out: dict = {}
    for e in entries:
        if (step is None or e.step == step) and e.kind in kinds:
            out[f"{e.phase}/{e.op}"] = out.get(f"{e.phase}/{e.op}", 0) + e.sent_bytes
    return {**out, "total": sum(out.values())}


def test_a_bounded_ledger_keeps_exact_aggregates_and_a_window_of_entries():
    steps = 12
    r = zeroedu.launch(bounded_ledger_run, world_size=2, args=(steps,))[0]   # the ledgers travel back pickled
    full, bounded = r["full"], r["bounded"]
    assert full.dropped == 0 and len(full) > 60
    assert len(bounded) <= 40 + 40 // 8 and bounded.dropped == len(full) - len(bounded)
    assert [(e.op, e.step, e.sent_bytes) for e in bounded] == [(e.op, e.step, e.sent_bytes)
                                                                for e in full[-len(bounded):]]
    assert bounded.steps() == list(range(steps - 5, steps))
    for s in range(steps - 5, steps):                    # aggregates of the kept steps: exact
        assert bounded.per_step(s) == by_hand(full, s) == full.per_step(s)
        assert list(bounded.per_step(s)) == list(by_hand(full, s))   # the same keys in the same order
    assert bounded.totals() == by_hand(full) == full.totals()       # running totals: every step since the start
    assert bounded.totals(kinds=("params",), field="calls")["total"] == sum(e.kind == "params" for e in full)
    assert "step 0 is older than the 5 steps this ledger keeps" in r["old_step"]
    assert full.per_step(0) == by_hand(full, 0)


def test_ledger_note_fills_the_entry_from_the_tensor():
    import pickle

    from zeroedu.comm import Ledger, LedgerEntry

    ledger = Ledger()
    t = torch.zeros(6, dtype=torch.bfloat16)
    e = ledger.note("d2h", "backward", "activations", 3, t, group=(0,), sent_bytes=12, impl="memcpy",
                    seconds=0.5, start=7.0)
    assert e == LedgerEntry(op="d2h", phase="backward", kind="activations", step=3, dtype="bfloat16", numel=6,
                            group=(0,), group_size=1, tensor_bytes=12, sent_bytes=12, sent_measured=True,
                            impl="memcpy", seconds=0.5, seq=-1, start=7.0)
    skip = ledger.note("skipped_step", "step", "scalar", 4, None, group=(0, 1), sent_bytes=0, impl="-")
    assert (skip.dtype, skip.numel, skip.tensor_bytes, skip.group_size) == ("-", 0, 0, 2)
    assert ledger.note("all_gather", "forward", "params", 4, t, dtype=torch.float32, group=(0, 1), sent_bytes=6,
                       impl="ring").dtype == "float32"   # a collective records its output's dtype
    assert list(ledger) == [e, skip, ledger[-1]]
    again = pickle.loads(pickle.dumps(ledger))
    assert list(again) == list(ledger) and again.totals(kinds=("activations",)) == {"backward/d2h": 12, "total": 12}
