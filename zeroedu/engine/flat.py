"""Flat buffers: many parameters as one tensor, cut into buckets, each bucket padded and split N ways.

Every stage uses the same layout. Parameters are laid out in model order and grouped greedily into buckets
of at most `bucket_numel` elements (a parameter larger than that gets a bucket of its own). Each bucket is
padded to a multiple of N, so that a reduce-scatter or all-gather of one bucket gives every rank an equal
contiguous *piece* of it. A rank's shard is its piece of every bucket, stored back to back:

    full flat:  [ bucket 0: r0 r1 r2 r3 | bucket 1: r0 r1 r2 r3 | ... ]   (compute dtype, stages 0-2)
    rank 1's shard: [ b0.r1 | b1.r1 | ... ]                             (contiguous, 1/N of the full)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]          # where each parameter starts inside the bucket
    shapes: list[torch.Size]    # each parameter's shape (stage 3 empties the parameters themselves)
    numel: int                  # real elements
    padded: int                 # numel rounded up to a multiple of N
    start: int                  # where the bucket starts in the full flat buffer
    shard_start: int            # where this bucket's piece starts in a rank's shard

    @property
    def piece(self) -> int:
        """Elements of this bucket that each rank owns."""
        return self.padded // self._world

    _world: int = field(default=1, repr=False)



class FlatLayout:
    """Where every parameter element lives in the full flat buffer and in each rank's shard."""

    def __init__(self, params: list[torch.nn.Parameter], world_size: int, bucket_numel: int | float = float("inf"),
                 groups: list[list[torch.nn.Parameter]] | None = None) -> None:
        """Greedy buckets of at most `bucket_numel` elements, or exactly the given `groups` (stage 3's units)."""
        self.world_size = world_size
        self.buckets: list[Bucket] = []
        # A parameter built inside zeroedu.zero.Init is empty until gathered: its real shape is zero_shape.
        shape = {p: getattr(p, "zero_shape", p.shape) for p in params}
        if groups is None:
            groups = []
            for p in params:
                if not groups or (sum(shape[q].numel() for q in groups[-1]) + shape[p].numel() > bucket_numel
                                  and groups[-1]):
                    groups.append([])
                groups[-1].append(p)
        self.params = [p for g in groups for p in g]
        start = shard_start = 0
        for i, group in enumerate(groups):
            offsets, n = [], 0
            for p in group:
                offsets.append(n)
                n += shape[p].numel()
            padded = math.ceil(n / world_size) * world_size
            shapes = [shape[p] for p in group]
            self.buckets.append(Bucket(i, group, offsets, shapes, n, padded, start, shard_start, world_size))
            start += padded
            shard_start += padded // world_size
        self.full_numel = start
        self.shard_numel = shard_start
        self.numel = sum(shape[p].numel() for p in params)

    # -- views ------------------------------------------------------------------------------------------
    def bucket_view(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        return full[b.start: b.start + b.padded]

    def piece_of_shard(self, shard: torch.Tensor, b: Bucket) -> torch.Tensor:
        return shard[b.shard_start: b.shard_start + b.piece]

    def piece_of_full(self, full: torch.Tensor, b: Bucket, rank: int) -> torch.Tensor:
        s = b.start + rank * b.piece
        return full[s: s + b.piece]

    def param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of `full` shaped like each parameter, in layout order."""
        views = []
        for b in self.buckets:
            views += self.param_views_of_bucket(self.bucket_view(full, b), b)
        return views

    def param_views_of_bucket(self, bucket_full: torch.Tensor, b: Bucket) -> list[torch.Tensor]:
        pairs = zip(b.shapes, b.offsets, strict=True)
        return [bucket_full[off: off + shape.numel()].view(shape) for shape, off in pairs]

    # -- copies -----------------------------------------------------------------------------------------
    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new full flat buffer holding `tensors` (one per parameter, layout order), zeros in the padding."""
        dtype = dtype or tensors[0].dtype
        full = torch.zeros(self.full_numel, dtype=dtype, device=tensors[0].device)
        for view, t in zip(self.param_views(full), tensors, strict=True):
            view.copy_(t)
        return full

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of a full flat buffer, as a new contiguous tensor."""
        return torch.cat([self.piece_of_full(full, b, rank) for b in self.buckets])
