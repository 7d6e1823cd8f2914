"""Counted collectives: every collective the engine runs goes through here and lands in the rank's ledger.

Implementations of each collective:
- "native": torch.distributed's own (NCCL's kernels on GPUs, gloo's on CPU). We cannot see what a native
  collective puts on the wire, so its `sent_bytes` is the ring algorithm's volume for that tensor
  (`sent_measured=False`): an algorithmic figure, not an observation.
- "ring": written here on isend/irecv, one neighbour to the next. `sent_bytes` adds up the payloads this rank
  actually handed to isend (`sent_measured=True`). gloo's reduce-scatter is an all-reduce plus a slice
  (docs/benchmarks.md, "Measurements behind the code"; notebook 02, section 4, times it), so on gloo the ring
  versions are also faster; `zeroedu bench --collectives` measures it.
- "direct": every rank sends each other rank its piece at once. The same bytes per rank as the ring (counted
  the same way), in one round instead of N-1.
- "auto": NCCL's own on GPUs; on gloo, per op, what measured fastest here among those that count their bytes.

Asynchronous collectives run on the comm thread (comm_thread.py), in submission order. When that thread has
nothing queued, a synchronous collective runs on the calling thread and a native one asked for asynchronously
is started right there (torch.distributed runs it on its own threads): the order is the same either way.

The pieces: the ledger in ledger.py, the comm thread in comm_thread.py, the algorithms in collectives.py. Their
public names are importable from here too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist

from zeroedu.comm.agreement import Agreement
from zeroedu.comm.collectives import (
    ALGORITHMS,
    ALL_GATHER_SINGLE,
    REDUCE_SCATTER_SINGLE,
    direct_together,
    native,
    single,
)
from zeroedu.comm.ledger import Ledger, LedgerEntry
from zeroedu.comm.ledger import rebuild_ledger as _rebuild_ledger  # noqa: F401 (old pickles name it here)
from zeroedu.comm.thread import Handle, worker

__all__ = ["ALL_GATHER_SINGLE", "AUTO_ON_GLOO", "REDUCE_SCATTER_SINGLE", "CollectiveObserver", "Comm", "Handle",
           "Ledger", "LedgerEntry", "observe"]

# "auto" on gloo, per op: the fastest of the implementations that count their sent bytes (gloo's reduce-scatter is
# an all-reduce plus a slice); the measurements: docs/benchmarks.md, "Measurements behind the code".
AUTO_ON_GLOO = {"all_reduce": "native", "reduce_scatter": "direct", "all_gather": "direct"}


_BUCKET = threading.local()   # .index: the bucket whose collectives this thread is running (Comm.for_bucket)


_AGREEMENT_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _agreement_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The gloo group the agreement checks run on: one per set of ranks and default group, shared by every engine
    of the process (a group per engine would hold sockets and threads for each engine a notebook ever made)."""
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    if key not in _AGREEMENT_GROUPS:
        _AGREEMENT_GROUPS[key] = dist.new_group(list(ranks), backend="gloo")
    return _AGREEMENT_GROUPS[key]


class CollectiveObserver(Protocol):
    """What watches this rank's collectives. The launcher installs one in every rank it starts (`observe`), so a
    mismatched collective or a hang is named with the ranks and the ops; the comm layer itself knows no launcher."""

    def next_seq(self, key: str) -> int:
        """The number of this rank's next collective on the group `key` ("0,1,2,3")."""

    def report(self, text: str | None) -> None:
        """This rank entered ("waiting|key|seq|op ...") or left ("done|...") a collective; None: user code."""


_observer: CollectiveObserver | None = None


def observe(observer: CollectiveObserver | None) -> None:
    """Install the observer of this process's collectives (None: none, as under torchrun or in a plain script)."""
    global _observer
    _observer = observer


def observer() -> CollectiveObserver | None:
    """The observer installed by `observe` (a launched rank's context), or None."""
    return _observer


def _group_seq(key: str) -> int | None:
    """The group's collective count shared with torch.distributed's own calls (the observer's), or None."""
    return None if _observer is None else _observer.next_seq(key)


def _report(text: str | None) -> None:
    if _observer is not None:
        _observer.report(text)


class Comm:
    """Collectives over one process group, counted in a ledger shared by every Comm of this rank."""

    def __init__(self, group: dist.ProcessGroup | None = None, implementation: str = "auto",
                 ledger: Ledger | None = None, name: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: start ranks with zeroedu.launch(fn, "
                               "world_size) or torchrun, or call zeroedu.launch.init_distributed().")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
            range(self.world_size))
        self.backend = dist.get_backend(group)
        if implementation == "auto" and self.backend != "gloo":
            implementation = "native"     # NCCL's own collectives
        if implementation not in {"ring", "direct", "native", "auto"}:
            raise ValueError(f"comm implementation must be 'auto', 'ring', 'direct' or 'native', got "
                             f"{implementation!r}")
        self.implementation = implementation
        self.ledger = Ledger() if ledger is None else ledger
        self.name = name or ",".join(map(str, self.ranks))
        self.phase = "other"
        self.step = 0
        self.parent: Comm | None = None   # a subgroup records the phase and step of the Comm that made it
        self._seq = 0
        self.last: str | None = None   # the last collective this rank entered (for hang reports)
        self.rounds = 0                # times this rank met its peers: a collective, or several run together()
        self.agreement: Agreement | None = None   # the per-step check that every rank ran the same collectives

    def start_agreement(self) -> None:
        """Check at every optimizer step (agree()) that every rank ran the same collectives (zeroedu.comm.agreement).
        Every rank of the group calls it, once, in the same order (it makes a process group)."""
        if self.agreement is None:
            self.agreement = Agreement(self.ranks, _agreement_group(self.ranks) if self.world_size > 1 else None,
                                       _observer)

    def agree(self, step: int, where: str) -> None:
        """One optimizer step's check: raises CollectiveDriftError if the previous step's showed a drift."""
        if self.agreement is not None:
            self.agreement.check(step, where)

    @staticmethod
    @contextmanager
    def for_bucket(index: int):
        """The collectives this thread starts inside belong to bucket `index`: part of what the ranks agree on, so
        two equal-size buckets reduced in different orders on two ranks are told apart."""
        old = getattr(_BUCKET, "index", None)
        _BUCKET.index = index
        try:
            yield
        finally:
            _BUCKET.index = old

    # -- context ----------------------------------------------------------------------------------------
    @contextmanager
    def in_phase(self, phase: str):
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    def subgroup(self, ranks: list[int], name: str | None = None) -> Comm | None:
        """A Comm over some of the ranks, sharing this ledger and following this Comm's phase and step.

        Every rank of the world must call it, for every group, in the same order (torch's new_group rule);
        ranks outside `ranks` get None.
        """
        group = dist.new_group(ranks)
        if dist.get_rank() not in ranks:
            return None
        sub = Comm(group, self.implementation, self.ledger, name)
        sub.parent = self
        return sub

    # -- public collectives -----------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, average: bool = True, kind: str = "grads",
                   async_op: bool = False) -> Handle | None:
        return self._run("all_reduce", t, None, kind, async_op, average=average)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, average: bool = True, kind: str = "grads",
                       async_op: bool = False) -> Handle | None:
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected "
                             f"{out.numel()} x {self.world_size}")
        return self._run("reduce_scatter", out, inp, kind, async_op, average=average)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, kind: str = "params",
                   async_op: bool = False) -> Handle | None:
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {out.numel()} elements, expected "
                             f"{inp.numel()} x {self.world_size}")
        return self._run("all_gather", out, inp, kind, async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0, kind: str = "params") -> None:
        self._run("broadcast", t, None, kind, False, src=src)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str = "grads",
                   async_op: bool = False) -> Handle | None:
        return self._run("all_to_all", out, inp, kind, async_op)

    # Coalesced versions: several tensors in one collective, as DeepSpeed's all_gather_coalesced and FSDP2's
    # per-group collectives do. Each rank's parts are packed rank by rank into one flat tensor, so the single
    # collective gives every rank exactly what one collective per tensor would have; the ledger gets one entry
    # with the same bytes as the separate ones. One message per ring step instead of one per tensor is what
    # makes many small gathers cheap where each collective costs a fixed latency.
    def all_gather_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor], kind: str = "params") -> None:
        """outs[i] (contiguous, N x ins[i].numel()) gets every rank's ins[i], rank by rank."""
        if len(ins) == 1:
            self.all_gather(outs[0], ins[0], kind)
            return
        if self.packs_nothing("all_gather"):
            self._run("all_gather", list(outs), list(ins), kind, False)
            return
        n = self.world_size
        mine = torch.cat([t.reshape(-1) for t in ins])
        rows = torch.empty(n, mine.numel(), dtype=mine.dtype, device=mine.device)
        self.all_gather(rows.view(-1), mine, kind)
        start = 0
        for out, t in zip(outs, ins, strict=True):
            out.view(n, t.numel()).copy_(rows[:, start: start + t.numel()])
            start += t.numel()

    def reduce_scatter_coalesced(self, outs: list[torch.Tensor], ins: list[torch.Tensor], average: bool = True,
                                 kind: str = "grads") -> None:
        """outs[i] gets this rank's 1/N piece of the sum (or average) over ranks of ins[i]."""
        if len(ins) == 1:
            self.reduce_scatter(outs[0], ins[0], average, kind)
            return
        if self.packs_nothing("reduce_scatter"):
            self._run("reduce_scatter", list(outs), list(ins), kind, False, average=average)
            return
        n = self.world_size
        width = sum(out.numel() for out in outs)
        packed = torch.empty(n, width, dtype=ins[0].dtype, device=ins[0].device)
        start = 0
        for out, t in zip(outs, ins, strict=True):
            packed[:, start: start + out.numel()].copy_(t.view(n, out.numel()))
            start += out.numel()
        mine = torch.empty(width, dtype=packed.dtype, device=packed.device)
        self.reduce_scatter(mine, packed.view(-1), average, kind)
        for out, part in zip(outs, mine.split([out.numel() for out in outs]), strict=True):
            out.view(-1).copy_(part)

    def together(self, calls: list[tuple[str, list[torch.Tensor], list[torch.Tensor], str, bool]]) -> None:
        """Coalesced collectives (op, outs, ins, kind, average), reduce-scatters and all-gathers, in one round of
        transfers where none of them packs (packs_nothing): each peer gets one batch of messages for all of them,
        so the ranks meet once instead of once per collective. Each is its own ledger entry with the bytes it
        would have alone; its seconds are the round's. Elsewhere they run one after the other."""
        if not all(self.packs_nothing(op) for op, *_ in calls):
            for op, outs, ins, kind, average in calls:
                if op == "all_gather":
                    self.all_gather_coalesced(outs, ins, kind)
                else:
                    self.reduce_scatter_coalesced(outs, ins, average, kind)
            return
        src = self.parent or self
        phase, step, bucket = src.phase, src.step, getattr(_BUCKET, "index", None)
        worker().run(lambda: self._call_together(calls, phase, step, bucket))

    def packs_nothing(self, op: str) -> bool:
        """Does a coalesced `op` run without packing (no buffer the size of all its tensors)? Yes where it runs
        "direct": every piece is sent from where it lies and received where it belongs. The ring and the native
        collectives take one flat tensor, so the tensors are packed into one first."""
        return self.world_size > 1 and self._implementation(op) == "direct"

    def run_async(self, fn: Callable[[], None]) -> Handle:
        """Run a closure (collectives plus the work that belongs with them) on the comm thread."""
        return worker().submit(fn)

    # -- machinery --------------------------------------------------------------------------------------
    def _run(self, op: str, a: torch.Tensor, b: torch.Tensor | None, kind: str, async_op: bool,
             **kw) -> Handle | None:
        src = self.parent or self
        phase, step = src.phase, src.step
        kw["bucket"] = getattr(_BUCKET, "index", None)
        if async_op and self.world_size > 1 and self._implementation(op) == "native" and worker().idle():
            # torch.distributed runs it on its own threads: no hand-off to ours. Nothing is queued there, so
            # the collectives still start in the order they were asked for.
            return self._call(op, a, b, kind, phase, step, native_async=True, **kw)
        job = lambda: self._call(op, a, b, kind, phase, step, **kw)  # noqa: E731
        if async_op:
            return worker().submit(job)
        worker().run(job)
        return None

    def _implementation(self, op: str) -> str:
        if op in {"broadcast", "all_to_all"}:
            return "native"
        return AUTO_ON_GLOO.get(op, "native") if self.implementation == "auto" else self.implementation

    def _begin(self, op: str, a, b, phase: str, kind: str = "", bucket: int | None = None) -> tuple:
        """Number the collective, say what this rank waits in (hang reports), and start its clocks."""
        self._seq += 1
        full = b if op == "reduce_scatter" else a  # the "S" of the ring formulas (a list: a coalesced collective)
        outs = a if isinstance(a, list) else [a]
        numel = sum(t.numel() for t in full) if isinstance(full, list) else full.numel()
        sig = f"{op} {str(outs[0].dtype).removeprefix('torch.')}[{numel}] ({phase})"
        agreement = (self.parent or self).agreement
        if agreement is not None:
            agreement.note(f"{sig} {kind}" if bucket is None else f"{sig} {kind} bucket {bucket}")
        self.last = f"#{self._seq} {sig}"
        shown = _group_seq(self.name) or self._seq   # in a launched rank: the group's count, raw calls included
        _report(f"waiting|{self.name}|{shown}|{sig}")
        return full, outs, sig, shown, self._seq, time.perf_counter(), time.time()

    def _end(self, op: str, kind: str, phase: str, step: int, started: tuple, sent: int, impl: str,
             divide_after: bool) -> None:
        """Average the output if asked, say the collective is done, and put it in the ledger."""
        full, outs, sig, shown, seq, t0, wall0 = started
        if divide_after:
            for t in outs:
                t.div_(self.world_size)
        _report(f"done|{self.name}|{shown}|{sig}")
        self.ledger.note(op, phase, kind, step, full, dtype=outs[0].dtype, group=self.ranks, sent_bytes=sent,
                         sent_measured=impl != "native" or self.world_size == 1, impl=impl,
                         seconds=time.perf_counter() - t0, seq=seq, start=wall0)

    @torch.no_grad()
    def _call(self, op: str, a: torch.Tensor, b: torch.Tensor | None, kind: str, phase: str, step: int,
              native_async: bool = False, bucket: int | None = None, **kw) -> Handle | None:
        started = self._begin(op, a, b, phase, kind, bucket)
        self.rounds += 1
        impl, work = self._implementation(op), None
        # Averaging: an all-reduce divides its input first (as DDP does: the division overlaps the transfer
        # of earlier buckets), the other collectives their result (1/N of the size).
        divide_first = kw.get("average") and self.world_size > 1 and op == "all_reduce"
        if divide_first:
            a.div_(self.world_size)
        if self.world_size == 1:
            sent = single(op, a, b)
        elif isinstance(a, list):
            sent = direct_together(self, [(op, a, b)])[0]
        elif impl in ALGORITHMS:
            sent = ALGORITHMS[impl][op](self, a, b)
        else:
            sent, work = native(self, op, a, b, native_async, src=kw.get("src", 0))
        divide_after = bool(kw.get("average")) and self.world_size > 1 and not divide_first

        def finish() -> None:
            self._end(op, kind, phase, step, started, sent, impl, divide_after)

        if work is not None:
            return Handle(work, finish)
        finish()
        return None

    @torch.no_grad()
    def _call_together(self, calls: list[tuple], phase: str, step: int, bucket: int | None = None) -> None:
        started = [self._begin(op, outs, ins, phase, kind, bucket) for op, outs, ins, kind, _ in calls]
        self.rounds += 1
        sent = direct_together(self, [(op, outs, ins) for op, outs, ins, *_ in calls])
        for (op, _, _, kind, average), st, nbytes in zip(calls, started, sent, strict=True):
            self._end(op, kind, phase, step, st, nbytes, "direct", average)
