"""`zeroedu bench --collectives`: zeroedu's ring and direct collectives against gloo's own."""

from __future__ import annotations

import statistics
import time

import torch

OPS = ("all_reduce", "reduce_scatter", "all_gather")
IMPLS = ("ring", "direct", "native")


def _collective_rank(rank: int, world: int, sizes: list[int], repeats: int) -> dict:
    """Per size and op, each repeat runs every implementation once (the order rotating)."""
    import torch.distributed as dist

    from zeroedu.comm import Comm

    comms = {impl: Comm(implementation=impl) for impl in IMPLS}
    out = {}
    for numel in sizes:
        x = torch.ones(numel)
        piece = torch.ones(numel // world)
        for op in OPS:
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for r in range(repeats + 1):   # the first repeat warms up
                for impl in IMPLS[r % len(IMPLS):] + IMPLS[: r % len(IMPLS)]:
                    comm = comms[impl]
                    dist.barrier()
                    t0 = time.perf_counter()
                    if op == "all_reduce":
                        comm.all_reduce(x)
                    elif op == "reduce_scatter":
                        comm.reduce_scatter(piece, x)
                    else:
                        comm.all_gather(x, piece)
                    if r:
                        times[impl].append(time.perf_counter() - t0)
            out[numel, op] = times
    return out


def collectives(world_size: int = 4, sizes_kib: tuple[float, ...] = (64 * 1024,), repeats: int = 5) -> str:
    """zeroedu's ring and direct collectives vs gloo's own, per op and size: the measurement behind
    comm.AUTO_ON_GLOO."""
    import zeroedu

    sizes = [max(world_size, int(kib * 1024) // 4 // world_size * world_size) for kib in sizes_kib]
    r = zeroedu.launch(_collective_rank, world_size=world_size, args=(sizes, repeats), timeout=1800)
    lines = [f"fp32 tensors, {world_size} gloo ranks, median of {repeats} repeats, implementations taking turns "
             "(wall time on this CPU; a collective takes as long as its slowest rank)",
             "| op | tensor KiB | ring ms | direct ms | gloo ms | ring / gloo | direct / gloo |",
             "|---|---|---|---|---|---|---|"]
    for op in OPS:
        for numel in sizes:
            t = {impl: [max(x) for x in zip(*(rank[numel, op][impl] for rank in r), strict=True)] for impl in IMPLS}
            ratio = {impl: statistics.median(a / b for a, b in zip(t[impl], t["native"], strict=True))
                     for impl in IMPLS}
            ms = " | ".join(f"{1e3 * statistics.median(t[impl]):.2f}" for impl in IMPLS)
            lines.append(f"| {op} | {numel * 4 / 1024:g} | {ms} | {ratio['ring']:.2f}x | {ratio['direct']:.2f}x |")
    return "\n".join(lines)


