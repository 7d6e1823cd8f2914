"""Stage 0: plain data parallelism, written from scratch.

Every rank holds everything: parameters, gradients, fp32 master weights, optimizer state (16 bytes per
parameter with mixed-precision Adam). Parameters and gradients live in flat buffers cut into buckets.
During the backward of the last micro-step, a bucket is all-reduced as soon as its last gradient has
arrived, while backward goes on computing the gradients of earlier layers (overlap). The all-reduce
averages, so every rank ends with the gradient of the global batch and takes the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroedu.comm.agreement import caller_line
from zeroedu.engine import Engine
from zeroedu.engine.flat import Bucket, FlatLayout
from zeroedu.engine.stages.sizing import reduce_bucket_numel


class Stage0(Engine):
    stage = 0
    # Stages 0-2 reduce buckets in one fixed order (reduce_complete_buckets). Stage 3 releases a unit when it is
    # reduced, so it keeps reducing in the order units complete (stages/stage3.py: its own handling).
    reduces_in_fixed_order = property(lambda self: self.stage < 3)

    def setup(self) -> None:
        if not self.params:
            raise ValueError(
                f"the model has no trainable parameters (it has {sum(1 for _ in self.module.parameters())} "
                f"parameters, none with requires_grad=True, and {sum(1 for _ in self.module.buffers())} buffers): "
                "there is nothing for ZeRO to shard or an optimizer to step. Pass the model that trains, or set "
                "requires_grad=True on the parameters to train (p.requires_grad_(True)).")
        super().setup()   # make_layout, place_parameters
        self.note_unsynced_buffers()
        self.comm.start_agreement()   # every optimizer step checks that the ranks ran the same collectives
        self.comm.agreement.accum = self.accum
        self._waiting: dict[int, int] = {}
        self._reduced: set[int] = set()
        self.setup_gradients()
        self.master_pieces = [torch.nn.Parameter(t) for t in self.master_source()]
        for p in self.layout.params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def note_unsynced_buffers(self) -> None:
        """Say so when the model has running statistics (BatchNorm and the like): each rank updates them from its
        own data and nothing syncs them, as in DeepSpeed 0.19.8 (its engine broadcasts parameters once, at init,
        never buffers); torch's DDP instead broadcasts rank 0's before every forward (broadcast_buffers=True)."""
        tracking = [n for n, m in self.module.named_modules() if getattr(m, "track_running_stats", False)]
        if tracking:
            self.log(f"zeroedu note: {len(tracking)} module(s) keep running statistics ({', '.join(tracking[:3])}"
                     f"{', ...' if len(tracking) > 3 else ''}): each rank updates its own from its own batches "
                     "and, as in DeepSpeed, nothing syncs them, so they differ between ranks (a checkpoint keeps "
                     "rank 0's). For the same statistics everywhere use torch.nn.SyncBatchNorm, or broadcast the "
                     "buffers from rank 0 before evaluating.")

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
        if self.comm.agreement is not None:   # sent at the step's check: tells a skipped step() apart
            self.note_unfinished_backward()
            self.comm.agreement.in_backward = True
            self.comm.agreement.backwards += 1
            self.comm.agreement.where = caller_line()
        self._waiting = {b.index: len(b.params) for b in self.layout.buckets}
        self._reduced = set()
        self._complete: set[int] = set()             # buckets whose every gradient is in
        self._next_bucket = len(self.layout.buckets) - 1   # the next to reduce (reduce_complete_buckets)

    def step(self) -> None:
        if self.comm.agreement is not None:
            self.note_unfinished_backward()
            self.comm.agreement.where = caller_line()   # shown if this step's collectives fail to match
        super().step()

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
            self._complete.add(b.index)
            if self.reduces_in_fixed_order:
                self.reduce_complete_buckets()
            else:
                self._reduced.add(b.index)
                self.post_backward(b)

    # Every rank reduces the buckets in one fixed order, last bucket first (the order backward usually completes
    # them), whatever order its own backward completes them in. A parameter unused on one rank (a routed expert,
    # a rank-dependent branch) leaves its bucket incomplete there until after backward, while the other ranks
    # complete it during backward: reducing each bucket when it completes would then pair bucket i's collective on
    # one rank with bucket j's on another (gloo swaps equal-size ones without a word). Its missing gradient counts
    # as zero, as in DeepSpeed's stages 1-2 and DDP's find_unused_parameters.
    def reduce_complete_buckets(self) -> None:
        """Reduce the next buckets in the fixed order, as long as they are complete."""
        while self._next_bucket >= 0 and self._next_bucket in self._complete:
            b = self.layout.buckets[self._next_bucket]
            self._next_bucket -= 1
            self._reduced.add(b.index)
            self.post_backward(b)

    def note_unfinished_backward(self) -> None:
        """The previous backward never reached after_backward: it raised, and the caller went on."""
        a = self.comm.agreement
        if a.in_backward:
            a.unfinished += 1
            a.unfinished_at = a.checks + 1 if a.unfinished_at is None else a.unfinished_at
            a.in_backward = False

    def after_backward(self) -> None:
        if self.comm.agreement is not None:
            self.comm.agreement.in_backward = False
        # Buckets with a parameter that got no gradient (unused in this forward on this rank) are reduced now, in
        # the same order on every rank, so that every rank runs the same collectives in the same order.
        if not self.reduces_this_micro_step():
            return
        if self.reduces_in_fixed_order:
            self._complete.update(b.index for b in self.layout.buckets)
            self.reduce_complete_buckets()
            return
        for b in self.layout.buckets:
            if b.index not in self._reduced:
                self.post_backward(b)

    def reduce_bucket(self, b: Bucket) -> None:
        """All-reduce (average) the bucket's gradients in place; with overlap_comm, while backward goes on."""
        grads = self.layout.bucket_view(self.flat_grads, b)
        self.overlap(self.for_bucket(b, lambda: self.comm.all_reduce(grads, average=True, kind="grads")))

    def for_bucket(self, b: Bucket, fn: Callable[[], None]) -> Callable[[], None]:
        """fn, with its collectives labelled as bucket b's: the ranks' per-step agreement check then tells two
        equal-size buckets apart (reduced in a different order on two ranks, they would swap gradients)."""
        def run() -> None:
            with self.comm.for_bucket(b.index):
                fn()
        return run

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
