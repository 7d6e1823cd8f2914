"""The collective algorithms behind Comm, each returning the bytes this rank sent.

- "native": torch.distributed's own (NCCL's kernels on GPUs, gloo's on CPU). What it puts on the wire is not
  visible, so its sent bytes are the ring algorithm's volume for the tensor: an algorithmic figure.
- "ring": on isend/irecv, one neighbour to the next, N-1 rounds a phase. Sent bytes add up the payloads.
- "direct": every rank sends each other rank its piece at once: the ring's bytes in one round instead of N-1.
Every function takes the group as `Peers` (a Comm is one): this rank, the group's size and global ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from zeroedu import compat

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; older torch (a GPU machine's 2.11,
# say) has only the old ones. zeroedu.compat picks whichever this torch has.
ALL_GATHER_SINGLE = compat.all_gather_single()
REDUCE_SCATTER_SINGLE = compat.reduce_scatter_single()


class Peers(Protocol):
    rank: int                       # this rank's index in the group
    world_size: int
    ranks: tuple[int, ...]          # the group's global ranks, by index
    group: dist.ProcessGroup | None


Algorithm = Callable[[Peers, torch.Tensor, "torch.Tensor | None"], int]


def single(op: str, a: torch.Tensor, b: torch.Tensor | None) -> int:
    """A group of one: the output is the input, nothing is sent."""
    if op in {"reduce_scatter", "all_gather", "all_to_all"}:
        a.copy_(b)
    return 0


def native(p: Peers, op: str, a: torch.Tensor, b: torch.Tensor | None, async_op: bool = False, src: int = 0):
    """torch.distributed's own collective; returns (the ring volume for the tensor, its Work if async)."""
    n, g = p.world_size, p.group
    size = (b if op == "reduce_scatter" else a)
    nbytes = size.numel() * size.element_size()
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n, dist.all_reduce(a, group=g, async_op=async_op)
    if op == "reduce_scatter":
        return (n - 1) * nbytes // n, REDUCE_SCATTER_SINGLE(a, b, group=g, async_op=async_op)
    if op == "all_gather":
        if b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
            b = b.clone()  # the input may be this rank's chunk of the output; native needs them apart
        return (n - 1) * nbytes // n, ALL_GATHER_SINGLE(a, b, group=g, async_op=async_op)
    if op == "all_to_all":
        return (n - 1) * nbytes // n, dist.all_to_all_single(a, b, group=g, async_op=async_op)
    if op == "broadcast":
        work = dist.broadcast(a, src=p.ranks[src], group=g, async_op=async_op)
        return (nbytes if p.rank == src else 0), work   # a tree or ring sends S at least once
    raise ValueError(op)


# -- ring: rank r sends to r+1 and receives from r-1, N-1 times per phase; chunk c is the c-th of N equal parts --

def exchange(p: Peers, send: torch.Tensor, recv: torch.Tensor) -> int:
    right = p.ranks[(p.rank + 1) % p.world_size]
    left = p.ranks[(p.rank - 1) % p.world_size]
    works = [dist.isend(send, right, group=p.group), dist.irecv(recv, left, group=p.group)]
    for w in works:
        w.wait()
    return send.numel() * send.element_size()


def ring_reduce_scatter(p: Peers, out: torch.Tensor, inp: torch.Tensor) -> int:
    n, r = p.world_size, p.rank
    chunks = inp.reshape(-1).chunk(n)
    # Step s: send the partial sum of chunk (r-s-1), receive chunk (r-s-2) and add our own part of it.
    # After n-1 steps the chunk we hold is chunk r, summed over every rank.
    partial = chunks[(r - 1) % n]
    recv = torch.empty_like(partial)
    sums = [torch.empty_like(partial) for _ in range(min(2, n - 1))]   # the one being sent, the next one
    sent = 0
    for s in range(n - 1):
        sent += exchange(p, partial, recv)
        partial = torch.add(recv, chunks[(r - s - 2) % n], out=sums[s % 2])
    out.reshape(-1).copy_(partial)
    return sent


def ring_all_gather(p: Peers, out: torch.Tensor, inp: torch.Tensor) -> int:
    n, r = p.world_size, p.rank
    chunks = out.reshape(-1).chunk(n)
    chunks[r].copy_(inp.reshape(-1))
    sent = 0
    # Step s: pass on the chunk that arrived last step (our own at s = 0).
    for s in range(n - 1):
        sent += exchange(p, chunks[(r - s) % n], chunks[(r - s - 1) % n])
    return sent


def padded_all_reduce(p: Peers, t: torch.Tensor, in_place: Callable[[Peers, torch.Tensor], int]) -> int:
    """Run an in-place all-reduce algorithm on t, through a zero-padded copy when t's length is not a
    multiple of N (or t is not contiguous); returns the bytes it sent."""
    n = p.world_size
    padded = -(-t.numel() // n) * n
    if padded == t.numel() and t.is_contiguous():
        return in_place(p, t.view(-1))
    work = torch.zeros(padded, dtype=t.dtype, device=t.device)
    work[: t.numel()].copy_(t.reshape(-1))
    sent = in_place(p, work)
    t.copy_(work[: t.numel()].view(t.shape))
    return sent


def ring_all_reduce_in_place(p: Peers, work: torch.Tensor) -> int:
    n, r = p.world_size, p.rank
    chunks = work.chunk(n)
    recv = torch.empty_like(chunks[0])
    sent = 0
    for s in range(n - 1):   # reduce-scatter in place: chunk (r-s-2) accumulates what arrives
        sent += exchange(p, chunks[(r - s - 1) % n], recv)
        chunks[(r - s - 2) % n].add_(recv)
    for s in range(n - 1):   # all-gather in place: chunk r is complete, pass complete chunks on
        sent += exchange(p, chunks[(r - s) % n], chunks[(r - s - 1) % n])
    return sent


def ring_all_reduce(p: Peers, t: torch.Tensor, _: torch.Tensor | None = None) -> int:
    return padded_all_reduce(p, t, ring_all_reduce_in_place)


# -- direct: each rank sends what it sends in the ring, N-1 pieces of S/N, in one round instead of N-1 (2(N-1) for
# all-reduce): cheaper where each round costs a fixed latency, as for small tensors; the ring uses one link per
# rank at a time. --

def exchange_all(p: Peers, sends: list[list[torch.Tensor]], recvs: list[list[torch.Tensor]]) -> None:
    """sends[k-1] go to the rank k places to the right and recvs[k-1] come from the rank k to the left, each a list
    of tensors in the same order on both sides; every transfer is in flight at once."""
    n, r = p.world_size, p.rank
    works = []
    for k, (send, recv) in enumerate(zip(sends, recvs, strict=True), start=1):
        works += [dist.irecv(t, p.ranks[(r - k) % n], group=p.group) for t in recv]
        works += [dist.isend(t, p.ranks[(r + k) % n], group=p.group) for t in send]
    for w in works:
        w.wait()


class Plan(NamedTuple):
    """One direct collective, ready to share a round: what goes to and comes from the rank k places away
    (sends[k-1], recvs[k-1]), and what to do once everything has arrived."""
    sends: list[list[torch.Tensor]]
    recvs: list[list[torch.Tensor]]
    finish: Callable[[], None]


def _receivable(out: torch.Tensor, inp: torch.Tensor, numel: int) -> bool:
    """Can a part be received straight into out? Not if out lies inside inp: its own chunk would be overwritten
    before it is added."""
    return (out.is_contiguous() and out.dtype == inp.dtype and out.numel() == numel
            and out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr())


def reduce_scatter_plan(p: Peers, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> Plan:
    """outs[i] = this rank's chunk of the sum over ranks of ins[i]. Nothing is packed: each chunk is sent from
    where it lies, and the part added first (from rank r+1) is received straight into outs[i] where it can be."""
    n, r = p.world_size, p.rank
    chunks = [t.reshape(-1).chunk(n) for t in ins]
    totals = [out.reshape(-1) for out in outs]
    into = [_receivable(out, t, c[r].numel()) for out, t, c in zip(outs, ins, chunks, strict=True)]
    recvs = [[torch.empty_like(c[r]) for c in chunks] for _ in range(n - 2)]
    recvs.append([total if ok else torch.empty_like(c[r]) for total, ok, c in zip(totals, into, chunks, strict=True)])

    def finish() -> None:   # add in the ring's order (rank r+1's part first, our own last): the ring's bits
        for i, (total, ok, c) in enumerate(zip(totals, into, chunks, strict=True)):
            if not ok:
                total.copy_(recvs[-1][i])
            for part in [*(rv[i] for rv in reversed(recvs[:-1])), c[r]]:
                total.add_(part)

    return Plan([[c[(r + k) % n] for c in chunks] for k in range(1, n)], recvs, finish)


def all_gather_plan(p: Peers, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> Plan:
    """outs[i] (contiguous, N x ins[i]) = every rank's ins[i], rank by rank, each piece received where it
    belongs (nothing packed)."""
    n, r = p.world_size, p.rank
    chunks = [out.view(-1).chunk(n) for out in outs]
    for c, t in zip(chunks, ins, strict=True):
        if c[r].data_ptr() != t.data_ptr():
            c[r].copy_(t.reshape(-1))
    mine = [c[r] for c in chunks]
    return Plan([mine] * (n - 1), [[c[(r - k) % n] for c in chunks] for k in range(1, n)], lambda: None)


PLANS = {"reduce_scatter": reduce_scatter_plan, "all_gather": all_gather_plan}


def direct_together(p: Peers, calls: list[tuple[str, list[torch.Tensor], list[torch.Tensor]]]) -> list[int]:
    """Direct collectives (op, outs, ins) in one round of transfers: each peer gets one batch of messages for all
    of them, in the same order on every rank. Returns the bytes each one sent."""
    plans = [PLANS[op](p, outs, ins) for op, outs, ins in calls]
    k_all = range(p.world_size - 1)
    exchange_all(p, [[t for pl in plans for t in pl.sends[k]] for k in k_all],
                 [[t for pl in plans for t in pl.recvs[k]] for k in k_all])
    for pl in plans:
        pl.finish()
    return [sum(t.numel() * t.element_size() for send in pl.sends for t in send) for pl in plans]


def direct_reduce_scatter(p: Peers, out: torch.Tensor, inp: torch.Tensor) -> int:
    return direct_together(p, [("reduce_scatter", [out], [inp])])[0]


def direct_all_gather(p: Peers, out: torch.Tensor, inp: torch.Tensor) -> int:
    return direct_together(p, [("all_gather", [out], [inp])])[0]


def direct_all_reduce_in_place(p: Peers, work: torch.Tensor) -> int:
    mine = torch.empty_like(work.chunk(p.world_size)[p.rank])
    return direct_reduce_scatter(p, mine, work) + direct_all_gather(p, work, mine)


def direct_all_reduce(p: Peers, t: torch.Tensor, _: torch.Tensor | None = None) -> int:
    return padded_all_reduce(p, t, direct_all_reduce_in_place)


ALGORITHMS: dict[str, dict[str, Algorithm]] = {
    "ring": {"all_reduce": ring_all_reduce, "reduce_scatter": ring_reduce_scatter, "all_gather": ring_all_gather},
    "direct": {"all_reduce": direct_all_reduce, "reduce_scatter": direct_reduce_scatter,
               "all_gather": direct_all_gather},
}
