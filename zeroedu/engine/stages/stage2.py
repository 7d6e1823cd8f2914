"""Stage 2 (P_os+g): partition the gradients too.

What changes from stage 1: no rank keeps a full-size gradient buffer. Autograd still produces each
parameter's full gradient, but as soon as a bucket's gradients are all there they are copied into a bucket
buffer, the parameters' .grad are freed, and the bucket is reduce-scattered into this rank's
gradient shard. That happens at every micro-step (a shard cannot hold the sum of full gradients for later),
so with gradient accumulation stage 2 communicates once per micro-step where stages 0 and 1 wait for the
boundary. A bucket buffer is made when its bucket is full and freed once it is reduce-scattered; at most two
exist at once, so that one can fill while the other is on the wire, and between steps a rank holds its model
states and nothing else. Without `reduce_bucket_size` in the config, a bucket is sized to the
model (zeroedu.stages.sizing), not DeepSpeed's fixed 5e8 elements.

Three DeepSpeed switches change this: `reduce_scatter: false` and `use_multi_rank_bucket_allreduce: true`
(DeepSpeed's default; zeroedu's is false, the paper's) each all-reduce each bucket and keep this rank's piece
(the same gradient for twice the bytes: a step moves 3 Psi elements instead of 2 Psi), and `contiguous_gradients:
false` changes nothing more here: each bucket's buffer is already a new tensor, freed once reduced.
"""

from __future__ import annotations

import torch

from zeroedu.engine.flat import Bucket
from zeroedu.engine.stages.stage1 import Stage1


class Stage2(Stage1):
    stage = 2
    partitions_grads = True

    def setup_gradients(self) -> None:
        self.flat_grads = None
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.bucket_buffers: list[torch.Tensor | None] = [None, None]   # the two in flight, while backward runs
        self._buffer_jobs: list = [None, None]
        self._next_buffer = 0
        self.bucket_bytes_high = 0

    def reduces_this_micro_step(self) -> bool:
        return True

    def before_backward(self) -> None:
        super(Stage1, self).before_backward()   # the gradient shard persists; nothing to allocate

    def bucket_buffer_numel(self) -> int:
        return max(b.padded for b in self.layout.buckets)

    def take_bucket_slot(self, b: Bucket | None = None) -> tuple[int, torch.Tensor]:
        """(slot, buffer): a new buffer of b's size (None: the largest bucket's) in slot 0 or 1, once the older
        of the two buffers in flight is done. Its reduce-scatter lets go of it: a rank holds only the bucket
        buffers still to be reduced."""
        i = self._next_buffer
        self._next_buffer = 1 - i
        if self._buffer_jobs[i] is not None:
            self._buffer_jobs[i].wait()
        n = self.bucket_buffer_numel() if b is None else b.padded
        self.bucket_buffers[i] = torch.empty(n, dtype=self.dtype, device=self.device)
        live = sum(t.untyped_storage().nbytes() for t in self.bucket_buffers if t is not None)
        self.bucket_bytes_high = max(self.bucket_bytes_high, live)   # the most bucket bytes alive at once so far
        return i, self.bucket_buffers[i]

    def take_bucket_buffer(self, b: Bucket | None = None) -> torch.Tensor:
        """A new buffer for bucket b's gradients (take_bucket_slot without the slot)."""
        return self.take_bucket_slot(b)[1]

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)   # returns once every reduce-scatter is done
        self.bucket_buffers, self._buffer_jobs, self._next_buffer = [None, None], [None, None], 0

    def reduce_bucket(self, b: Bucket) -> None:
        slot, buf = self.take_bucket_slot(b)
        self.move_grads(b, buf)
        self.reduce_to_shard([b], [buf], slot)

    def move_grads(self, b: Bucket, buf: torch.Tensor) -> None:
        """Copy bucket b's gradients into buf (zeros for a parameter that got none, and in the padding)."""
        for p, view in zip(b.params, self.layout.param_views_of_bucket(buf, b), strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = None          # the full-size gradient is freed here
        buf[b.numel:].zero_()

    def reduce_to_shard(self, buckets: list[Bucket], bufs: list[torch.Tensor], slot: int) -> None:
        """Reduce the filled buffer(s) of bucket slot `slot` into this rank's gradient shard, overlapped; the
        slot's buffer goes once they are reduced."""
        outs = [self.grad_out(b) for b in buckets]

        def job() -> None:
            self.reduce_scatter_buckets(bufs, outs)
            self.bucket_buffers[slot] = None   # reduced: the buffer goes (the main thread takes the slot after this)

        self._buffer_jobs[slot] = self.overlap(self.for_bucket(buckets[0], job))

    def reduce_scatter_buckets(self, bufs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Add to each out this rank's piece of its buffer, averaged over ranks: one collective for them all (a
        bucket, or the units waiting in one). Runs on the comm thread under overlap_comm. ZeRO++'s qgZ
        replaces the collective here."""
        if not self.all_reduces_buckets():
            reduced = [torch.empty_like(out, dtype=bufs[0].dtype) for out in outs]
            self.comm.reduce_scatter_coalesced(reduced, bufs, average=True, kind="grads")
        else:   # all-reduce each bucket (2x the bytes: DeepSpeed's default at stages 1-2) and keep this rank's piece
            reduced = []
            for buf, out in zip(bufs, outs, strict=True):
                self.comm.all_reduce(buf, average=True, kind="grads")
                reduced.append(buf[self.rank * out.numel(): (self.rank + 1) * out.numel()])
        for out, r in zip(outs, reduced, strict=True):
            out.add_(r)            # micro-steps accumulate in the shard

    def grad_pieces(self) -> list[torch.Tensor]:
        return [self.layout.piece_of_shard(self.grad_shard, b) for b in self.layout.buckets]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def owned(self) -> dict[str, list[torch.Tensor]]:
        grads = [p.grad for p in self.params if p.grad is not None]   # full grads waiting for their bucket
        return {**super().owned(), "gradients": [self.grad_shard, *grads], "buckets": self.bucket_buffers}
