"""Stage 2 (P_os+g): partition the gradients too.

What changes from stage 1: no rank keeps a full-size gradient buffer. Autograd still produces each
parameter's full gradient, but as soon as a bucket's gradients are all there they are copied into a small
reusable bucket buffer, the parameters' .grad are freed, and the bucket is reduce-scattered into this rank's
gradient shard. That happens at every micro-step (a shard cannot hold the sum of full gradients for later),
so with gradient accumulation stage 2 communicates once per micro-step where stages 0 and 1 wait for the
boundary. Two bucket buffers alternate so one can fill while the other is on the wire.
"""

from __future__ import annotations

import torch

from zeroedu.flat import Bucket
from zeroedu.stages.stage1 import Stage1


class Stage2(Stage1):
    stage = 2

    def setup_gradients(self) -> None:
        self.flat_grads = None
        self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype)
        biggest = max(b.padded for b in self.layout.buckets)
        self.bucket_buffers = [torch.empty(biggest, dtype=self.dtype) for _ in range(2)]
        self._buffer_jobs: list = [None, None]
        self._next_buffer = 0

    def reduces_this_micro_step(self) -> bool:
        return True

    def before_backward(self) -> None:
        super(Stage1, self).before_backward()   # the gradient shard persists; nothing to allocate

    def take_bucket_buffer(self, b: Bucket) -> torch.Tensor:
        """The next free bucket buffer (waiting for its previous reduce-scatter if needed)."""
        i = self._next_buffer
        self._next_buffer = 1 - i
        if self._buffer_jobs[i] is not None:
            self._buffer_jobs[i].wait()
        return self.bucket_buffers[i][: b.padded]

    def reduce_bucket(self, b: Bucket) -> None:
        i = self._next_buffer
        buf = self.take_bucket_buffer(b)
        for p, view in zip(b.params, self.layout.param_views_of_bucket(buf, b), strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
                p.grad = None          # the full-size gradient is freed here
        buf[b.numel:].zero_()
        out = self.grad_out(b)

        def job() -> None:
            reduced = torch.empty_like(out)
            self.comm.reduce_scatter(reduced, buf, average=True, kind="grads")
            out.add_(reduced)          # micro-steps accumulate in the shard

        if self.overlap:
            self._buffer_jobs[i] = self.comm.run_async(job)
            self._handles.append(self._buffer_jobs[i])
        else:
            job()

    def grad_pieces(self) -> list[torch.Tensor]:
        return [self.layout.piece_of_shard(self.grad_shard, b) for b in self.layout.buckets]

    def zero_grads(self) -> None:
        self.grad_shard.zero_()

    def owned(self) -> dict[str, list[torch.Tensor]]:
        grads = [p.grad for p in self.params if p.grad is not None]   # full grads waiting for their bucket
        return {**super().owned(), "gradients": [self.grad_shard, *grads], "buckets": self.bucket_buffers}
