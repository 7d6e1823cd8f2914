"""Stage 0: plain data parallelism, written from scratch.

Every rank holds everything: parameters, gradients, fp32 master weights, optimizer state (16 bytes per
parameter with mixed-precision Adam). Parameters and gradients live in flat buffers cut into buckets.
During the backward of the last micro-step, a bucket is all-reduced as soon as its last gradient has
arrived, while backward goes on computing the gradients of earlier layers (overlap). The all-reduce
averages, so every rank ends with the gradient of the global batch and takes the same step.
"""

from __future__ import annotations

import torch

from zeroedu.engine import Engine
from zeroedu.engine.flat import Bucket, FlatLayout
from zeroedu.engine.stages.sizing import reduce_bucket_numel


class Stage0(Engine):
    stage = 0

    def setup(self) -> None:
        super().setup()   # make_layout, place_parameters
        self._waiting: dict[int, int] = {}
        self._reduced: set[int] = set()
        self.setup_gradients()
        self.master_pieces = [torch.nn.Parameter(t) for t in self.master_source()]
        for p in self.layout.params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def make_layout(self) -> None:
        """Buckets of reduce_bucket_size elements, in model order."""
        self.bucket_numel = reduce_bucket_numel(self.config, self.module)   # the config's, or sized to the model
        self.layout = FlatLayout(self.params, self.world_size, self.bucket_numel)
        self._bucket_of = {p: b for b in self.layout.buckets for p in b.params}

    def place_parameters(self) -> None:
        """Every parameter becomes a view of one flat buffer, so a bucket is one contiguous tensor."""
        self.flat_params = self.layout.flatten([p.data for p in self.layout.params])
        for p, view in zip(self.layout.params, self.layout.param_views(self.flat_params), strict=True):
            p.data = view

    # Where gradients live: a flat buffer whose views are the parameters' .grad, so autograd accumulates
    # straight into the buckets and micro-steps add up in place.
    def setup_gradients(self) -> None:
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.grad_dtype)
        views = self.layout.param_views(self.flat_grads)
        if self.grad_dtype == self.dtype:
            for p, view in zip(self.layout.params, views, strict=True):
                p.grad = view
        else:   # grad_accum_dtype: autograd's gradient (compute dtype) is added in and freed, one at a time
            self._grad_views = dict(zip(self.layout.params, views, strict=True))

    def master_source(self) -> list[torch.Tensor]:
        """What the fp32 master pieces are: here every bucket, whole."""
        src = self.flat_params if self.dtype == torch.float32 else self.flat_params.float()
        self.flat_master = src
        return [self.layout.bucket_view(src, b) for b in self.layout.buckets]

    # -- backward ---------------------------------------------------------------------------------------
    def reduces_this_micro_step(self) -> bool:
        return self.is_gradient_accumulation_boundary()

    def before_backward(self) -> None:
        self._waiting = {b.index: len(b.params) for b in self.layout.buckets}
        self._reduced = set()

    def on_grad_ready(self, p: torch.nn.Parameter) -> None:
        """p.grad is complete: count it, and reduce its bucket once the bucket's last gradient is in."""
        if self.grad_dtype != self.dtype and not self.partitions_grads:
            self._grad_views[p].add_(p.grad)
            p.grad = None
        if not self.reduces_this_micro_step():
            return
        b = self._bucket_of[p]
        self._waiting[b.index] -= 1
        if self._waiting[b.index] == 0:
            self._reduced.add(b.index)
            self.post_backward(b)

    def after_backward(self) -> None:
        # Buckets with a parameter that got no gradient (unused in this forward) are reduced now, in bucket
        # order, so that every rank runs the same collectives in the same order.
        if self.reduces_this_micro_step():
            for b in self.layout.buckets:
                if b.index not in self._reduced:
                    self.post_backward(b)

    def reduce_bucket(self, b: Bucket) -> None:
        """All-reduce (average) the bucket's gradients in place; with overlap_comm, while backward goes on."""
        grads = self.layout.bucket_view(self.flat_grads, b)
        self.overlap(lambda: self.comm.all_reduce(grads, average=True, kind="grads"))

    # -- step -------------------------------------------------------------------------------------------
    def grad_pieces(self) -> list[torch.Tensor]:
        return [self.layout.bucket_view(self.flat_grads, b) for b in self.layout.buckets]

    def param_home(self, b: Bucket) -> torch.Tensor:
        return self.layout.bucket_view(self.flat_params, b)

    def publish(self) -> None:
        if self.flat_master is not self.flat_params:
            self.flat_params.copy_(self.flat_master)

    def zero_grads(self) -> None:
        self.flat_grads.zero_()

    def owned(self) -> dict[str, list[torch.Tensor]]:
        return {**super().owned(), "gradients": [self.flat_grads]}

    def master_full(self) -> torch.Tensor:
        return self.flat_master.float()
