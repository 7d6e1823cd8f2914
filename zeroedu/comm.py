"""Counted collectives: every collective the engine runs goes through here and lands in the rank's ledger.

Implementations of each collective:
- "native": torch.distributed's own (NCCL's kernels on GPUs, gloo's on CPU). We cannot see what a native
  collective puts on the wire, so its `sent_bytes` is the ring algorithm's volume for that tensor
  (`sent_measured=False`): an algorithmic figure, not an observation.
- "ring": written here on isend/irecv, one neighbour to the next. `sent_bytes` adds up the payloads this rank
  actually handed to isend (`sent_measured=True`). gloo's reduce-scatter is an all-reduce plus a slice
  (DESIGN.md), so on gloo the ring versions are also faster; `zeroedu bench --collectives` measures it.
- "direct": every rank sends each other rank its piece at once. The same bytes per rank as the ring (counted
  the same way), in one round instead of N-1.
- "auto": NCCL's own on GPUs; on gloo, per op, what measured fastest here among those that count their bytes.

Asynchronous collectives run on one worker thread per process, in submission order. That gives overlap (the
main thread keeps computing backward while a bucket reduces) and keeps every rank's order of collectives
identical, which is what makes them match up. Handing a collective to another thread costs about a
millisecond on a busy CPU, so when that thread has nothing queued, a synchronous collective runs on the
calling thread and a native one asked for asynchronously is started right there (torch.distributed runs it
on its own threads): the order is the same either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

# "auto" on gloo, per op, from what `zeroedu bench --collectives` measured here (docs/benchmarks.md; 16 KiB to
# 64 MiB, 2 and 4 ranks). Reduce-scatter and all-gather run "direct": at 4 ranks it took 0.38-0.59x of gloo's
# reduce-scatter time (gloo's is an all-reduce plus a slice: twice the bytes) and 0.40-0.91x of its
# all-gather time, never slower than the ring. At 2 ranks (one exchange, whatever the algorithm) gloo's own is
# faster below about 1 MiB, where every collective is a fixed latency, and slower above; the direct exchange
# keeps its sent bytes counted from the sends, which the ledger and the course need. gloo's own all-reduce
# is as fast as anything here at 1 MiB and above, so all-reduce stays native.
AUTO_ON_GLOO = {"all_reduce": "native", "reduce_scatter": "direct", "all_gather": "direct"}

# torch 2.13 renamed the single-tensor collectives and deprecated the old names; torch 2.11 and 2.12 (a GPU machine's
# build, say) have only the old ones. Same signature, same semantics.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(slots=True)
class LedgerEntry:
    op: str
    phase: str
    kind: str
    step: int
    dtype: str
    numel: int
    group: tuple[int, ...]
    group_size: int
    tensor_bytes: int        # bytes of the full tensor (all-reduce: the tensor; rs: the input; ag: the output)
    sent_bytes: int          # bytes this rank sent (measured for "ring", ring volume for "native")
    sent_measured: bool
    impl: str
    seconds: float           # wall time of the call on this rank (gloo: the collective; NCCL: enqueuing it)
    seq: int
    start: float = 0.0       # time.time() when it started, for per-rank timelines


class Ledger(list):
    """The collectives of one rank, in order: a list of LedgerEntry with summaries, bounded for long runs.

    A run appends about 8 entries a step (more at stage 3), and a list of all of them grows by about 4 KB a step:
    gigabytes over a million steps. So the ledger keeps two things:
    - per-step aggregates (calls, tensor bytes, sent bytes by kind, phase and op) for the newest `max_steps`
      steps, and running totals since the start: `per_step()` and `totals()` read these, never the raw list;
    - the raw entries themselves (this list) for the newest `max_entries` only: `select()`, `by()`, `sent()`,
      `rows()` and iteration see those.
    Both limits are plenty for the course's runs (a few steps). None keeps everything, for a run that needs every
    entry: `engine.ledger.max_entries = None` before training, or `Ledger.max_entries = None` for every ledger
    made afterwards. `dropped` counts the raw entries let go.
    """

    max_entries: int | None = 10_000
    max_steps: int | None = 1_000

    def __init__(self, entries=(), max_entries: int | None = ..., max_steps: int | None = ...) -> None:
        super().__init__()
        if max_entries is not ...:
            self.max_entries = max_entries
        if max_steps is not ...:
            self.max_steps = max_steps
        self.dropped = 0
        self._kept_from: int | None = None   # aggregates of steps below this were let go
        self._steps: dict[int, dict[tuple[str, str, str], list[int]]] = {}   # step -> (kind, phase, op) -> sums
        self._totals: dict[tuple[str, str, str], list[int]] = {}
        self.extend(entries)

    def __reduce__(self):   # list subclasses unpickle their items before their attributes: say how instead
        return _rebuild_ledger, (list(self), self.__dict__)

    # -- recording --
    def append(self, e: LedgerEntry) -> None:
        key = (e.kind, e.phase, e.op)
        for sums in (self._steps.setdefault(e.step, {}).setdefault(key, [0, 0, 0]),
                     self._totals.setdefault(key, [0, 0, 0])):
            sums[0] += 1
            sums[1] += e.tensor_bytes
            sums[2] += e.sent_bytes
        if self.max_steps is not None and len(self._steps) > self.max_steps:
            for old in sorted(self._steps)[: len(self._steps) - self.max_steps]:
                del self._steps[old]
                self._kept_from = max(old + 1, self._kept_from or 0)
        super().append(e)
        limit = self.max_entries
        if limit is not None and len(self) > limit + max(1, limit // 8):   # trim in batches: amortized O(1)
            cut = len(self) - limit
            del self[:cut]
            self.dropped += cut

    def extend(self, entries) -> None:
        for e in entries:
            self.append(e)

    def __iadd__(self, entries):
        self.extend(entries)
        return self

    # -- summaries --
    def rows(self) -> list[dict]:
        return [asdict(e) for e in self]

    def select(self, **match) -> Ledger:
        return Ledger((e for e in self if all(getattr(e, k) == v for k, v in match.items())),
                      max_entries=None, max_steps=None)

    def sent(self, **match) -> int:
        return sum(e.sent_bytes for e in self.select(**match))

    def by(self, *keys: str, field: str = "sent_bytes", **match) -> dict:
        """Sum of `field` grouped by the given keys, e.g. by("phase", "op", step=3)."""
        out: dict = defaultdict(int)
        for e in self.select(**match):
            k = tuple(getattr(e, key) for key in keys)
            out[k[0] if len(k) == 1 else k] += getattr(e, field)
        return dict(out)

    def steps(self) -> list[int]:
        """The steps whose aggregates are kept (the newest max_steps)."""
        return sorted(self._steps)

    def per_step(self, step: int, kinds: tuple[str, ...] = ("params", "grads"), field: str = "sent_bytes"
                 ) -> dict[str, int]:
        """Bytes sent in one optimizer step as "phase/op" -> bytes (the keys zeroedu.theory uses); `field`
        "tensor_bytes" or "calls" for those instead. From the per-step aggregates: no scan of the entries."""
        if self._kept_from is not None and step < self._kept_from:
            raise KeyError(f"step {step} is older than the {len(self._steps)} steps this ledger keeps "
                           f"({min(self._steps)} to {max(self._steps)}); set ledger.max_steps (None: all) before "
                           "the run to keep more")
        return _by_phase_op(self._steps.get(step, {}), kinds, field)

    def totals(self, kinds: tuple[str, ...] = ("params", "grads"), field: str = "sent_bytes") -> dict[str, int]:
        """per_step's sums over every step since the ledger started, however many entries were let go."""
        return _by_phase_op(self._totals, kinds, field)


_FIELDS = {"calls": 0, "tensor_bytes": 1, "sent_bytes": 2}


def _by_phase_op(sums: dict[tuple[str, str, str], list[int]], kinds: tuple[str, ...], field: str) -> dict[str, int]:
    if field not in _FIELDS:
        raise ValueError(f"field must be one of {', '.join(_FIELDS)}, got {field!r}")
    out: dict[str, int] = defaultdict(int)
    for (kind, phase, op), values in sums.items():
        if kind in kinds:
            out[f"{phase}/{op}"] += values[_FIELDS[field]]
    out = dict(out)
    out["total"] = sum(out.values())
    return out


def _rebuild_ledger(entries: list, state: dict) -> Ledger:
    ledger = Ledger(max_entries=None, max_steps=None)
    list.extend(ledger, entries)
    ledger.__dict__.update(state)
    return ledger


class Handle:
    """A collective (or a closure of them) running on the comm thread; or a native collective that
    torch.distributed runs on its own threads (`work`), finished by `finish` at the first wait."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._work, self._finish = work, finish
        self._lock = threading.Lock()

    def wait(self) -> None:
        if self._work is not None:
            with self._lock:
                if not self._done.is_set():
                    try:
                        self._work.wait()
                        self._finish()
                    except BaseException as e:
                        self._error = e
                    self._done.set()
        self._done.wait()
        if self._error is not None:
            raise self._error


class _Worker:
    """The one thread per process that runs collectives, in order."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.pending = 0                    # jobs submitted and not finished
        self.count = threading.Lock()       # guards pending
        self.running = threading.Lock()     # held while a job runs, here or inline in a caller
        # The CUDA device is per thread: the comm thread works on the device of the thread that started it.
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.thread = threading.Thread(target=self._run, name="zeroedu-comm", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        while True:
            fn, handle = self.jobs.get()
            with self.running:
                try:
                    fn()
                except BaseException as e:  # handed to whoever waits
                    handle._error = e
            del fn   # before the waiter wakes: the job's closure would keep the buffers it names alive
            with self.count:
                self.pending -= 1
            handle._done.set()

    def submit(self, fn: Callable[[], None]) -> Handle:
        h = Handle()
        if threading.current_thread() is self.thread:  # already on the comm thread: run inline
            try:
                fn()
            except BaseException as e:
                h._error = e
            h._done.set()
            return h
        with self.count:
            self.pending += 1
        self.jobs.put((fn, h))
        return h

    def idle(self) -> bool:
        with self.count:
            return self.pending == 0

    def run(self, fn: Callable[[], None]) -> None:
        """Run fn and return when it is done. With nothing queued or running, the caller runs it itself: the
        same order as submitting and waiting, without waking the comm thread (a thread hand-off costs about a
        millisecond on a busy CPU, more than a small collective)."""
        if threading.current_thread() is not self.thread:
            with self.count:
                idle = self.pending == 0
                self.pending += idle
            if idle:
                try:
                    with self.running:
                        fn()
                finally:
                    with self.count:
                        self.pending -= 1
                return
        self.submit(fn).wait()


_WORKER: _Worker | None = None


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None or not _WORKER.thread.is_alive():
        _WORKER = _Worker()
    return _WORKER


def _report(text: str | None) -> None:
    try:
        from zeroedu.launch import report_status
    except ImportError:
        return
    report_status(text)


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

    def run_async(self, fn: Callable[[], None]) -> Handle:
        """Run a closure (collectives plus the work that belongs with them) on the comm thread."""
        return _worker().submit(fn)

    # -- machinery --------------------------------------------------------------------------------------
    def _run(self, op: str, a: torch.Tensor, b: torch.Tensor | None, kind: str, async_op: bool,
             **kw) -> Handle | None:
        src = self.parent or self
        phase, step = src.phase, src.step
        if async_op and self.world_size > 1 and self._implementation(op) == "native" and _worker().idle():
            # torch.distributed runs it on its own threads: no hand-off to ours. Nothing is queued there, so
            # the collectives still start in the order they were asked for.
            return self._call(op, a, b, kind, phase, step, native_async=True, **kw)
        job = lambda: self._call(op, a, b, kind, phase, step, **kw)  # noqa: E731
        if async_op:
            return _worker().submit(job)
        _worker().run(job)
        return None

    def _implementation(self, op: str) -> str:
        if op in {"broadcast", "all_to_all"}:
            return "native"
        return AUTO_ON_GLOO.get(op, "native") if self.implementation == "auto" else self.implementation

    @torch.no_grad()
    def _call(self, op: str, a: torch.Tensor, b: torch.Tensor | None, kind: str, phase: str, step: int,
              native_async: bool = False, **kw) -> Handle | None:
        self._seq += 1
        full = b if op == "reduce_scatter" else a  # the "S" of the ring formulas
        sig = f"{op} {str(a.dtype).removeprefix('torch.')}[{full.numel()}] ({phase})"
        self.last = f"#{self._seq} {sig}"
        _report(f"waiting|{self.name}|{self._seq}|{sig}")
        t0, wall0, seq = time.perf_counter(), time.time(), self._seq
        impl, work = self._implementation(op), None
        # Averaging: an all-reduce divides its input first (as DDP does: the division overlaps the transfer
        # of earlier buckets), the other collectives their result (1/N of the size).
        divide_first = kw.get("average") and self.world_size > 1 and op == "all_reduce"
        if divide_first:
            a.div_(self.world_size)
        if self.world_size == 1:
            sent = self._single(op, a, b)
        elif impl in ("ring", "direct"):
            sent = getattr(self, f"_{impl}_{op}")(a, b)
        else:
            sent, work = self._native(op, a, b, native_async, **kw)

        def finish() -> None:
            if kw.get("average") and self.world_size > 1 and not divide_first:
                a.div_(self.world_size)
            _report(f"done|{self.name}|{seq}|{sig}")
            self.ledger.append(LedgerEntry(
                op=op, phase=phase, kind=kind, step=step, dtype=str(a.dtype).removeprefix("torch."),
                numel=full.numel(), group=self.ranks, group_size=self.world_size,
                tensor_bytes=full.numel() * full.element_size(), sent_bytes=int(sent),
                sent_measured=impl != "native" or self.world_size == 1, impl=impl,
                seconds=time.perf_counter() - t0, seq=seq, start=wall0))

        if work is not None:
            return Handle(work, finish)
        finish()
        return None

    def _single(self, op: str, a: torch.Tensor, b: torch.Tensor | None) -> int:
        if op in {"reduce_scatter", "all_gather", "all_to_all"}:
            a.copy_(b)
        return 0

    def _native(self, op: str, a: torch.Tensor, b: torch.Tensor | None, async_op: bool = False, **kw):
        """torch.distributed's own collective; returns (the ring volume for the tensor, its Work if async)."""
        n, g = self.world_size, self.group
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
            src = kw.get("src", 0)
            work = dist.broadcast(a, src=self.ranks[src], group=g, async_op=async_op)
            return (nbytes if self.rank == src else 0), work   # a tree or ring sends S at least once
        raise ValueError(op)

    # Ring algorithms. Rank r sends to r+1 and receives from r-1, N-1 times per phase. Chunk c of the
    # tensor is the c-th of N equal parts.
    def _exchange(self, send: torch.Tensor, recv: torch.Tensor) -> int:
        right = self.ranks[(self.rank + 1) % self.world_size]
        left = self.ranks[(self.rank - 1) % self.world_size]
        works = [dist.isend(send, right, group=self.group), dist.irecv(recv, left, group=self.group)]
        for w in works:
            w.wait()
        return send.numel() * send.element_size()

    def _ring_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> int:
        n, r = self.world_size, self.rank
        chunks = inp.reshape(-1).chunk(n)
        # Step s: send the partial sum of chunk (r-s-1), receive chunk (r-s-2) and add our own part of it.
        # After n-1 steps the chunk we hold is chunk r, summed over every rank.
        partial = chunks[(r - 1) % n]
        recv = torch.empty_like(partial)
        sums = [torch.empty_like(partial) for _ in range(min(2, n - 1))]   # the one being sent, the next one
        sent = 0
        for s in range(n - 1):
            sent += self._exchange(partial, recv)
            partial = torch.add(recv, chunks[(r - s - 2) % n], out=sums[s % 2])
        out.reshape(-1).copy_(partial)
        return sent

    def _ring_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> int:
        n, r = self.world_size, self.rank
        chunks = out.reshape(-1).chunk(n)
        chunks[r].copy_(inp.reshape(-1))
        sent = 0
        # Step s: pass on the chunk that arrived last step (our own at s = 0).
        for s in range(n - 1):
            sent += self._exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n])
        return sent

    def _padded_all_reduce(self, t: torch.Tensor, in_place: Callable[[torch.Tensor], int]) -> int:
        """Run an in-place all-reduce algorithm on t, through a zero-padded copy when t's length is not a
        multiple of N (or t is not contiguous); returns the bytes it sent."""
        n = self.world_size
        padded = -(-t.numel() // n) * n
        if padded == t.numel() and t.is_contiguous():
            return in_place(t.view(-1))
        work = torch.zeros(padded, dtype=t.dtype, device=t.device)
        work[: t.numel()].copy_(t.reshape(-1))
        sent = in_place(work)
        t.copy_(work[: t.numel()].view(t.shape))
        return sent

    def _ring_all_reduce(self, t: torch.Tensor, _: torch.Tensor | None = None) -> int:
        return self._padded_all_reduce(t, self._ring_all_reduce_in_place)

    def _ring_all_reduce_in_place(self, work: torch.Tensor) -> int:
        n, r = self.world_size, self.rank
        chunks = work.chunk(n)
        recv = torch.empty_like(chunks[0])
        sent = 0
        for s in range(n - 1):   # reduce-scatter in place: chunk (r-s-2) accumulates what arrives
            sent += self._exchange(chunks[(r - s - 1) % n], recv)
            chunks[(r - s - 2) % n].add_(recv)
        for s in range(n - 1):   # all-gather in place: chunk r is complete, pass complete chunks on
            sent += self._exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n])
        return sent

    # Direct algorithms: every rank exchanges its pieces with every other rank at once. Each rank sends what it
    # sends in the ring, N-1 pieces of S/N, but in one round instead of N-1 (2(N-1) for all-reduce): cheaper
    # where each round costs a fixed latency, as for small tensors; the ring uses one link per rank at a time.
    def _exchange_all(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> int:
        """sends[k-1] goes to the rank k places to the right, recvs[k-1] comes from the rank k to the left."""
        n, r = self.world_size, self.rank
        works = []
        for k, (send, recv) in enumerate(zip(sends, recvs, strict=True), start=1):
            works.append(dist.irecv(recv, self.ranks[(r - k) % n], group=self.group))
            works.append(dist.isend(send, self.ranks[(r + k) % n], group=self.group))
        for w in works:
            w.wait()
        return sum(t.numel() * t.element_size() for t in sends)

    def _direct_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> int:
        n, r = self.world_size, self.rank
        chunks = inp.reshape(-1).chunk(n)
        recvs = [torch.empty_like(chunks[r]) for _ in range(n - 1)]
        sent = self._exchange_all([chunks[(r + k) % n] for k in range(1, n)], recvs)
        # Add in the ring's order (rank r+1's part first, our own last), so both give the same bits.
        total = out.reshape(-1)
        total.copy_(recvs[-1])
        for part in [*reversed(recvs[:-1]), chunks[r]]:
            total.add_(part)
        return sent

    def _direct_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> int:
        n, r = self.world_size, self.rank
        chunks = out.reshape(-1).chunk(n)
        chunks[r].copy_(inp.reshape(-1))
        return self._exchange_all([chunks[r]] * (n - 1), [chunks[(r - k) % n] for k in range(1, n)])

    def _direct_all_reduce(self, t: torch.Tensor, _: torch.Tensor | None = None) -> int:
        return self._padded_all_reduce(t, self._direct_all_reduce_in_place)

    def _direct_all_reduce_in_place(self, work: torch.Tensor) -> int:
        mine = torch.empty_like(work.chunk(self.world_size)[self.rank])
        return self._direct_reduce_scatter(mine, work) + self._direct_all_gather(work, mine)
