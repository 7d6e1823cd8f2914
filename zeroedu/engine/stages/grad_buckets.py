"""Stage 3's gradient buckets: units' gradients wait in a bucket until `reduce_bucket_size` elements are ready for
one reduce-scatter.

Units are small (one module's own parameters) and every collective costs a fixed latency however small its tensor,
so, as in DeepSpeed, the units whose gradients complete one after another share one bucket buffer and one
coalesced reduce-scatter. The first backward records the order units complete in; later backwards that follow it
send a bucket as soon as the next unit would not fit (the same buckets, on the wire sooner).

Where gloo's direct collectives pack nothing and overlap_comm is on (Stage3.fusing), a full bucket's reduce-scatter
waits (`deferred`) for the next gather the coordinator starts, moments later, and both go in one round of
transfers (Comm.together): the ranks meet once for the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GradBuckets:
    """The units waiting in the bucket, the recorded order, and the one reduce-scatter that may wait for a gather.

    `send(buckets, bufs, slot)` queues a reduce-scatter of the filled buffers of a bucket slot (Stage 2's
    reduce_to_shard); the engine supplies its bucket slots (take_bucket_slot), move_grads, grad_out and fusing().
    """

    def __init__(self, engine, send: Callable[[list, list[torch.Tensor], int], None]) -> None:
        self.engine, self.send = engine, send
        self.pending: list[tuple] = []     # (unit, its slice of the bucket buffer), in the order they came
        self.bucket: torch.Tensor | None = None
        self.slot = 0
        self.order: list[int] = []         # units in the order their gradients completed, in the first backward
        self.recording, self.pos = True, 0
        self.deferred: tuple | None = None   # a bucket's reduce-scatter waiting to go with the next gather

    def start_backward(self) -> None:
        self.pos = 0

    def add(self, b) -> None:
        """Unit b's gradients go into the bucket; the bucket is reduce-scattered when the next unit would not fit."""
        e = self.engine
        filled = sum(x.padded for x, _ in self.pending)
        if self.pending and filled + b.padded > len(self.bucket):
            self.flush()
            filled = 0
        if not self.pending:
            self.slot, self.bucket = e.take_bucket_slot()
        buf = self.bucket[filled: filled + b.padded]
        e.move_grads(b, buf)
        self.pending.append((b, buf))
        if self._next_would_not_fit(b, filled + b.padded):
            self.flush()

    def _next_would_not_fit(self, b, filled: int) -> bool:
        """Will the next unit to reduce (as the first backward recorded them) start a new bucket? Then this one
        can go now instead of waiting for it. Any other order than the recorded one: wait, as on the first
        backward."""
        order, k = self.order, self.pos
        self.pos += 1
        if self.recording:
            order.append(b.index)
            return False
        if k >= len(order) or order[k] != b.index:
            self.pos = len(order) + 1   # not the recorded order: no more predictions in this backward
            return False
        return k + 1 == len(order) or filled + self.engine.layout.buckets[order[k + 1]].padded > len(self.bucket)

    def flush(self) -> None:
        """Reduce-scatter the units waiting in the bucket, in one collective (through engine.reduce_to_shard)."""
        if self.pending:
            units, bufs = zip(*self.pending, strict=True)
            self.engine.reduce_to_shard(list(units), list(bufs), self.slot)
            self.pending, self.bucket = [], None

    def defer(self, buckets: list, bufs: list[torch.Tensor], slot: int) -> None:
        """Hold this reduce-scatter for the next gather (one waits at a time)."""
        self.send_deferred()
        self.deferred = (buckets, bufs, slot)

    def send_deferred(self) -> None:
        """The reduce-scatter that waited for a gather goes on its own."""
        if self.deferred is not None:
            buckets, bufs, slot = self.deferred
            self.deferred = None
            self.send(buckets, bufs, slot)

    def reduce_with_gather(self, part: list, bufs: list[torch.Tensor], before: Callable[[], None] | None = None):
        """One job for the waiting reduce-scatter and the plain gather of `part`, in one round (Comm.together);
        both wait for its handle: take_bucket_slot for the bucket's slot, fetch() for the units. `before` runs
        first in the job (stage 3's check that every rank gathers the same units: it raises instead)."""
        e = self.engine
        buckets, grads, slot = self.deferred
        self.deferred = None
        outs = [e.grad_out(b) for b in buckets]

        def job() -> None:
            if before is not None:
                before()
            reduced = [torch.empty_like(out, dtype=grads[0].dtype) for out in outs]
            e.comm.together([("reduce_scatter", reduced, grads, "grads", True),
                             ("all_gather", bufs, [e.param_piece(b) for b in part], "params", False)])
            e.bucket_buffers[slot] = None   # reduced: the buffer goes
            for out, r in zip(outs, reduced, strict=True):
                out.add_(r)            # micro-steps accumulate in the shard

        handle = e.overlap(job)        # overlap_comm is on (fusing): backward's wait() waits for it too
        e.set_bucket_job(slot, handle)
        return handle

    def end_backward(self) -> None:
        self.flush()
        self.send_deferred()
        if self.recording and self.order:
            self.recording = False   # the order units reached post_backward: the next backwards' order
