"""Stage 1 (P_os): partition the optimizer state.

What changes from stage 0: each rank keeps fp32 master weights and Adam state for its own 1/N piece of every
bucket only (12 bytes x Psi/N instead of 12 x Psi). So at the accumulation boundary a bucket is
reduce-scattered instead of all-reduced: each rank receives just the averaged gradient of its piece, steps
that piece, and an all-gather hands every rank the updated parameters. Reduce-scatter plus all-gather move
the same bytes as one all-reduce (2 Psi), so the memory saving costs no extra communication.
"""

from __future__ import annotations

import torch

from zeroedu.engine.flat import Bucket
from zeroedu.engine.stages.stage0 import Stage0


class Stage1(Stage0):
    stage = 1
    sharded = True

    def master_source(self) -> list[torch.Tensor]:
        """The master pieces are this rank's piece of each bucket, as one contiguous fp32 shard."""
        self.param_shard_views = [self.layout.piece_of_full(self.flat_params, b, self.rank)
                                  for b in self.layout.buckets]
        if self.dtype == torch.float32:   # the fp32 parameters are the master weights
            self.master_shard = None
            return self.param_shard_views
        self.master_shard = self.layout.shard_of(self.flat_params, self.rank).float()
        return [self.layout.piece_of_shard(self.master_shard, b) for b in self.layout.buckets]

    def setup_gradients(self) -> None:
        super().setup_gradients()
        self.grad_shard: torch.Tensor | None = None

    def before_backward(self) -> None:
        super().before_backward()
        # The reduced gradient of this rank's pieces exists only from the last backward to the step.
        if self.reduces_this_micro_step():
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)

    def reduce_bucket(self, b: Bucket) -> None:
        grads = self.layout.bucket_view(self.flat_grads, b)
        out = self.grad_out(b)
        self.overlap(self.for_bucket(b, lambda: self.reduce_to_piece(out, grads, b)))

    def all_reduces_buckets(self) -> bool:
        """Does a gradient bucket go by all-reduce (then this rank keeps its piece) instead of reduce-scatter?
        Yes with `reduce_scatter: false`, and at stages 1-2 with `use_multi_rank_bucket_allreduce: true`, which
        is DeepSpeed's default (`average_tensor` in deepspeed/runtime/zero/stage_1_and_2.py all-reduces the bucket
        whatever `reduce_scatter` says): the same gradient for twice the reduce bytes. DeepSpeed's stage 3 has
        no such key, so it changes nothing there."""
        zc = self.config.zero_optimization
        return not zc.reduce_scatter or (self.stage in (1, 2) and zc.use_multi_rank_bucket_allreduce)

    def reduce_to_piece(self, out: torch.Tensor, grads: torch.Tensor, b: Bucket) -> None:
        """out = this rank's piece of the bucket's gradient averaged over ranks: by reduce-scatter (the paper),
        or from an all-reduce of the whole bucket (all_reduces_buckets): the same result for twice the bytes."""
        if not self.all_reduces_buckets():
            self.comm.reduce_scatter(out, grads, average=True, kind="grads")
        else:
            self.comm.all_reduce(grads, average=True, kind="grads")
            out.copy_(grads[self.rank * b.piece: (self.rank + 1) * b.piece])

    def grad_out(self, b: Bucket) -> torch.Tensor:
        """Where bucket b's reduced gradient lands: this rank's piece of the gradient shard (offload: a staging
        piece on the device, copied to the host shard afterwards)."""
        return self.layout.piece_of_shard(self.grad_shard, b)

    def grad_pieces(self) -> list[torch.Tensor]:
        return [self.layout.piece_of_shard(self.grad_shard, b) for b in self.layout.buckets]

    def param_home(self, b: Bucket) -> torch.Tensor:
        return self.param_shard_views[b.index]

    def publish(self) -> None:
        if self.config.zero_optimization.allgather_bucket_size is not None:
            self.publish_in_chunks(self.config.zero_optimization.allgather_bucket_size)
            return
        if self.comm.packs_nothing("all_gather"):
            # One all-gather for every bucket: each piece lands where it lives in the flat parameters, so this
            # costs no buffer, and a step pays one collective's latency instead of one per bucket.
            for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
                self.write_back(b, master)
            self.comm.all_gather_coalesced([self.layout.bucket_view(self.flat_params, b) for b in self.layout.buckets],
                                           [self.param_home(b) for b in self.layout.buckets], kind="params")
            return
        # Otherwise one per bucket (a coalesced one would pack them all into one more buffer): with overlap_comm
        # they queue back to back on the comm thread, and the next bucket's write-back overlaps this one's gather.
        for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
            self.write_back(b, master)
            full, mine = self.layout.bucket_view(self.flat_params, b), self.param_home(b)
            self.overlap(lambda full=full, mine=mine: self.comm.all_gather(full, mine, kind="params"))
        self.wait()

    def publish_in_chunks(self, chunk_numel: int) -> None:
        """`allgather_bucket_size`: all-gathers of at most chunk_numel elements (N x this rank's part), whatever
        the reduce buckets are, as DeepSpeed cuts its stage 1-2 parameter all-gather. A chunk is a stretch of the
        shard (this rank's pieces, back to back), so it may span several buckets or part of one; what arrives is
        copied to where each rank's piece lives in the flat parameters."""
        n, per_rank = self.world_size, max(1, chunk_numel // self.world_size)
        for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
            self.write_back(b, master)
        spans = [(b, b.shard_start, b.shard_start + b.piece) for b in self.layout.buckets]
        for start in range(0, self.layout.shard_numel, per_rank):
            end = min(start + per_rank, self.layout.shard_numel)
            parts = [(b, max(s, start), min(e, end)) for b, s, e in spans if s < end and e > start]
            mine = torch.cat([self.param_shard_views[b.index][lo - b.shard_start: hi - b.shard_start]
                              for b, lo, hi in parts])
            rows = torch.empty(n, end - start, dtype=mine.dtype, device=mine.device)
            self.comm.all_gather(rows.view(-1), mine, kind="params")
            for r in range(n):
                at = 0
                for b, lo, hi in parts:
                    dst = self.layout.piece_of_full(self.flat_params, b, r)[lo - b.shard_start: hi - b.shard_start]
                    dst.copy_(rows[r, at: at + hi - lo])
                    at += hi - lo

    def zero_grads(self) -> None:
        super().zero_grads()
        self.grad_shard = None

    def owned(self) -> dict[str, list[torch.Tensor]]:
        return {**super().owned(), "gradients": [self.flat_grads, self.grad_shard]}

    def master_full(self) -> torch.Tensor:
        full = torch.zeros(self.layout.full_numel, dtype=torch.float32, device=self.device)
        for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
            self.comm.all_gather(self.layout.bucket_view(full, b), master.data.float(), kind="other")
        return full
