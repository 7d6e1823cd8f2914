"""Stage 3 (P_os+g+p): partition the parameters too.

What changes from stage 2: between uses, a rank holds only its 1/N shard of the parameters. The model is
cut into *units*, one per module that owns parameters. Just before a module's forward its units are
all-gathered, and released after their last use in the forward; they are gathered again just before the
module's backward, and released once their gradients are reduce-scattered (as at stage 2). So each step
moves parameters twice and gradients once: 3 Psi where stages 0-2 move 2 Psi.

The first forward records the order in which modules run. From then on:
- a unit is released right after the last module of the forward that needs it (a tied weight, used by the
  embedding and by the output head, stays until the head is done);
- the next units in that order are prefetched while the current module computes, up to
  `stage3_prefetch_bucket_size` elements in flight and `stage3_max_live_parameters` gathered at once
  (backward prefetches in reverse order);
- units smaller than `stage3_param_persistence_threshold` elements are never released: they are too small
  for a gather to pay off. They are all-gathered once after each optimizer step;
- with `stage3_max_reuse_distance` D > 0, a unit is not released after its last forward use when its next use,
  its own backward, comes before D elements of parameters are used in between (every module call after it in
  forward, then the same calls again in backward, counted as DeepSpeed counts them): the last units of the
  forward stay gathered for the backward, which starts with them. It is gathered once that step instead of
  twice. D = 0 (zeroedu's default) keeps none: 3 Psi a step.

Units are small (one module's own parameters), and every collective costs a fixed latency however small its
tensor. So, as in DeepSpeed, the units that start gathering together travel in one coalesced all-gather, and
gradients wait in a bucket until `reduce_bucket_size` elements are ready for one reduce-scatter. In backward,
where gloo's direct collectives pack nothing, a bucket's reduce-scatter waits for the next prefetch (the next
module's backward starts it, moments later) and both go in one round of transfers (Comm.together): the ranks meet
once for the two, the bytes and the ledger's entries are those of the two collectives.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from zeroedu import zero
from zeroedu.checkpointing import recomputing
from zeroedu.flat import Bucket, FlatLayout
from zeroedu.stages.sizing import is_leaf, max_live_numel, module_units, prefetch_numel, reduce_bucket_numel
from zeroedu.stages.stage2 import Stage2
from zeroedu.stages.units import ForwardTrace, UnitState


class Stage3(Stage2):
    stage = 3
    coalesce = True   # False: one collective per unit (same bytes, same result, many more collectives)
    # False: a bucket's reduce-scatter runs in its own round, not with the next gather (same bytes, same result).
    # Offload and ZeRO++ set it False: they queue work behind the reduce-scatter or replace its collectives.
    fuse_backward = True

    def setup(self) -> None:
        super().setup()   # units, this rank's shard, gradient shard, master pieces, gradient hooks
        self._pending: list[tuple[Bucket, torch.Tensor]] = []   # units whose gradients wait in the bucket
        self._grad_order: list[int] = []   # units in the order their gradients completed, in the first backward
        self._recording_grads, self._grad_pos = True, 0
        self._deferred: tuple | None = None   # a bucket's reduce-scatter waiting to go with the next gather
        self.trace = ForwardTrace()
        for m in self.module.modules():
            if self.units_of[m] or m is self.module:
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward)
        for m in self.leaves:
            m.register_full_backward_hook(lambda m, grad_in, grad_out: self._leaf_backward_done(m))
        zero.adopt(self)   # GatheredParameters now gathers and writes back through this engine

    def make_layout(self) -> None:
        """Units: the parameters each module owns directly (a shared parameter belongs to its first module)."""
        zc = self.config.zero_optimization
        self.bucket_numel = reduce_bucket_numel(self.config, self.module)   # the config's, or sized to the model
        self.prefetch_numel = prefetch_numel(self.config, self.module)
        self.max_live = max_live_numel(self.config, self.module)
        units = module_units(self.module)
        self.unit_modules = [m for m, _ in units]
        self.layout = FlatLayout(self.params, self.world_size, groups=[params for _, params in units])
        self._bucket_of = {p: b for b in self.layout.buckets for p in b.params}
        inside = {sub for m in self.module.modules() if is_leaf(m) and m is not self.module
                  for sub in m.modules() if sub is not m}
        # The units a module's hooks gather: its own parameters' (a leaf: everything inside it; inside a leaf: none)
        self.units_of = {m: [] if m in inside else
                         sorted({self._bucket_of[p].index for p in m.parameters(recurse=is_leaf(m))
                                 if p in self._bucket_of}) for m in self.module.modules()}
        self.leaves = [m for m in self.module.modules() if is_leaf(m) and m not in inside and m is not self.module]
        self.persistent = {b.index for b in self.layout.buckets if b.numel < zc.stage3_param_persistence_threshold}
        self.reused: set[int] = set()   # units kept gathered from forward to backward (set when the trace is done)

    def place_parameters(self) -> None:
        """This rank keeps its shard, filled one unit at a time: a model built inside zeroedu.zero.Init is
        gathered unit by unit (GatheredParameters), so no rank ever holds the whole model."""
        self.param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.unit_buffers: dict[int, torch.Tensor] = {}  # unit -> its full buffer (storage empty when released)
        self.gathered: dict[int, torch.Tensor] = {}     # unit -> its full buffer, while GATHERED
        self.inflight: dict[int, tuple] = {}            # unit -> (handle, buffer), while GATHERING
        for b in self.layout.buckets:
            full = torch.zeros(b.padded, dtype=self.dtype, device=self.device)
            with zero.GatheredParameters(b.params):
                for view, p in zip(self.layout.param_views_of_bucket(full, b), b.params, strict=True):
                    view.copy_(p.data)
            for p in b.params:
                p.zero_partition = None   # Init's pieces of this unit are in the shard now: let them go
            self.layout.piece_of_shard(self.param_shard, b).copy_(full[self.rank * b.piece: (self.rank + 1) * b.piece])
            if b.index in self.persistent:
                self._attach(b, full)
            else:
                self._detach(b)
        del full

    def master_source(self) -> list[torch.Tensor]:
        """The master pieces are this rank's pieces of the parameter shard (an fp32 copy unless fp32)."""
        if self.dtype == torch.float32:   # the fp32 parameter shard is the master
            self.master_shard = None
            src = self.param_shard
        else:
            self.master_shard = src = self.param_shard.float()
        return [self.layout.piece_of_shard(src, b) for b in self.layout.buckets]

    # -- gather and release -----------------------------------------------------------------------------
    # Each unit has one full-size buffer whose *storage* is freed on release (resized to 0 bytes) and
    # re-allocated on gather. Autograd may have saved views of a weight (nn.Linear saves weight.t()): they
    # keep pointing at the same storage, so they cost nothing while released and see the re-gathered values
    # in backward. The parameters themselves point at an empty tensor while released.
    def unit_state(self, u: int) -> UnitState:
        """Unit u's state, read from where it is (gathered, inflight): exercise 6's fetch and release keep those."""
        if u in self.gathered:
            return UnitState.GATHERED
        return UnitState.GATHERING if u in self.inflight else UnitState.RELEASED

    def unit_buffer(self, b: Bucket) -> torch.Tensor:
        """Unit b's full-size buffer, with its storage allocated: what its all-gather fills."""
        if b.index not in self.unit_buffers:
            self.unit_buffers[b.index] = torch.empty(b.padded, dtype=self.dtype, device=self.device)
        buf = self.unit_buffers[b.index]
        nbytes = b.padded * buf.element_size()
        if buf.untyped_storage().nbytes() != nbytes:
            buf.untyped_storage().resize_(nbytes)
        return buf

    def _attach(self, b: Bucket, buf: torch.Tensor) -> None:
        self.gathered[b.index] = buf
        for p, view in zip(b.params, self.layout.param_views_of_bucket(buf, b), strict=True):
            p.data = view

    def _detach(self, b: Bucket) -> None:
        self.gathered.pop(b.index, None)
        for p in b.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        if b.index in self.unit_buffers:
            self.unit_buffers[b.index].untyped_storage().resize_(0)

    def param_home(self, b: Bucket) -> torch.Tensor:
        return self.layout.piece_of_shard(self.param_shard, b)

    def param_piece(self, b: Bucket) -> torch.Tensor:
        """This rank's piece of unit b on the device, as its all-gather sends it (called on the comm thread;
        offload_param brings it from the host or NVMe here)."""
        return self.param_home(b)

    def start_gathers(self, units: list[Bucket]) -> None:
        """Start gathering these RELEASED units on the comm thread (they are GATHERING until fetched): one
        coalesced all-gather for all of them, or one each without coalescing. ZeRO++ picks the source here."""
        for part in [units] if self.coalesce else [[b] for b in units]:
            bufs = [self.unit_buffer(b) for b in part]
            if self._deferred is not None:
                handle = self._gather_and_reduce(part, bufs)
                for b, buf in zip(part, bufs, strict=True):
                    self.inflight[b.index] = (handle, buf)
                continue
            job = lambda part=part, bufs=bufs: self.comm.all_gather_coalesced(  # noqa: E731
                bufs, [self.param_piece(b) for b in part])
            handle = self.overlap(job, prefetch=True)   # fetch() waits for this handle, not wait()
            for b, buf in zip(part, bufs, strict=True):
                self.inflight[b.index] = (handle, buf)

    def fetch(self, u: int) -> None:
        """Make unit u whole, now (waiting for its prefetch if one is on the way)."""
        if self.unit_state(u) is UnitState.GATHERED:
            return
        if self.unit_state(u) is UnitState.RELEASED:
            self.start_gathers([self.layout.buckets[u]])
        handle, buf = self.inflight.pop(u)
        handle.wait()
        self._attach(self.layout.buckets[u], buf)

    def release(self, u: int) -> None:
        """Free unit u's full parameters (RELEASED), unless it is persistent or not gathered."""
        if self.unit_state(u) is UnitState.GATHERED and u not in self.persistent:
            self._detach(self.layout.buckets[u])

    def live_numel(self) -> int:
        units = [u for u in (*self.gathered, *self.inflight) if u not in self.persistent]
        return sum(self.layout.buckets[u].padded for u in units)

    def prefetch(self, calls: range) -> None:
        """Start gathering the units of the next module calls in the recorded order, within the budgets."""
        if not self.trace.follows:
            return
        budget, live, start = self.prefetch_numel, self.live_numel(), []
        for u in dict.fromkeys(u for j in calls for u in self.units_of[self.trace.modules[j]]):
            if self.unit_state(u) is not UnitState.RELEASED or u in self._reduced:
                continue
            n = self.layout.buckets[u].padded
            if n > budget or live + n > self.max_live:
                break
            budget, live = budget - n, live + n
            start.append(self.layout.buckets[u])
        if start:
            self.start_gathers(start)

    # -- forward hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, m: torch.nn.Module, args) -> None:
        if recomputing():   # activation checkpointing runs m again in backward: gather, leave the trace alone
            for u in self.units_of[m]:
                self.fetch(u)
            return
        i = self.trace.enter(m)
        for u in self.units_of[m]:
            self.fetch(u)
        if i == 0:
            self._reduced = set()   # a new forward: no unit has been reduced in it yet
        self.prefetch(range(i + 1, len(self.trace.modules)))

    def _post_forward(self, m: torch.nn.Module, args, out) -> None:
        if recomputing():   # released once its gradients are reduced, as in any backward
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, m=m: self._pre_backward(m, None))
            return
        i = self.trace.leave()
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, m=m, i=i: self._pre_backward(m, i))
        done = m is self.module   # the whole forward is done
        if done:
            first = self.trace.recording
            self.trace.end(self.units_of)
            if first:   # the order is known now, and with it what is used again soon
                self.reused = self.reused_units()
        # Kept for the backward: only in a forward that runs as recorded, with grad (else no backward follows).
        keep = self.reused if self.trace.follows and torch.is_grad_enabled() else set()
        if self.trace.follows:
            for u in self.units_of[m]:
                if self.trace.last_use.get(u) == i and u not in keep:
                    self.release(u)
        if done:
            for u in list(self.gathered):
                if u not in keep:
                    self.release(u)

    def reused_units(self) -> set[int]:
        """The units whose backward comes within `stage3_max_reuse_distance` elements of their last forward use.

        Modules run backward in the reverse of their forward order, so what comes between call j's end and its
        backward is every call after j, twice: once in forward, once in backward."""
        limit = self.config.zero_optimization.stage3_max_reuse_distance
        sizes = [sum(self.layout.buckets[u].numel for u in self.units_of[m]) for m in self.trace.modules]
        kept, after = set(), 0
        for j in range(len(sizes) - 1, -1, -1):
            if 2 * after < limit:
                kept.update(u for u in self.units_of[self.trace.modules[j]]
                            if self.trace.last_use[u] == j and u not in self.persistent)
            after += sizes[j]
        return kept

    def _pre_backward(self, m: torch.nn.Module, i: int | None) -> None:
        for u in self.units_of[m]:
            if u not in self._reduced:     # reduced already: this module's backward is over
                self.fetch(u)
        if i is not None:                  # None: a recomputed module, which has no place in the trace
            self.prefetch(range(i - 1, -1, -1))
        self.send_deferred()               # no gather started here to take it along

    def _leaf_backward_done(self, m: torch.nn.Module) -> None:
        """A leaf's backward reached its input: every gradient it will produce is in (autograd accumulates a
        parameter's gradient as soon as it is computed, before it goes on to the module's input). A parameter
        inside it that got none on this rank (an expert no token was routed to) counts as zero: its unit is
        reduced here, at the same point of the backward on every rank, as DeepSpeed's leaf hook does."""
        if not self.reduces_this_micro_step():
            return
        for u in self.units_of[m]:
            if u not in self._reduced:
                self._reduced.add(u)
                self.post_backward(self.layout.buckets[u])   # move_grads fills a missing gradient with zeros

    def on_grad_ready(self, p: torch.nn.Parameter) -> None:
        """As at stages 0-2; a gradient arriving for a unit already reduced (a leaf's, once its backward ended)
        would be lost: say so rather than train on without it."""
        b = self._bucket_of[p]
        if self.reduces_this_micro_step() and b.index in self._reduced and self._waiting.get(b.index, 0) > 0:
            raise RuntimeError(f"the gradient of {self.names.get(p, 'a parameter')} arrived after its stage-3 leaf "
                               "module's backward had ended, and its unit was reduced already. A leaf's output "
                               "must reach the loss through the leaf's input (its input must require grad).")
        super().on_grad_ready(p)

    # -- backward: release, then reduce as at stage 2 ----------------------------------------------------
    def bucket_buffer_numel(self) -> int:
        biggest = super().bucket_buffer_numel()
        if not self.coalesce:
            return biggest
        return max(biggest, min(self.bucket_numel, self.layout.full_numel))

    def post_backward(self, b: Bucket) -> None:
        """Unit b's gradients are complete, so its backward is over: release the unit, reduce its gradients."""
        self.release(b.index)
        self.reduce_bucket(b)

    def reduce_bucket(self, b: Bucket) -> None:
        """Unit b's gradients go into the bucket; the bucket is reduce-scattered when the next unit would not
        fit (units are small: one collective for many)."""
        if not self.coalesce:
            super().reduce_bucket(b)
            return
        filled = sum(x.padded for x, _ in self._pending)
        if self._pending and filled + b.padded > len(self._bucket):
            self.flush_gradients()
            filled = 0
        if not self._pending:
            self._bucket_slot, self._bucket = self.take_bucket_slot()
        buf = self._bucket[filled: filled + b.padded]
        self.move_grads(b, buf)
        self._pending.append((b, buf))
        if self._next_would_not_fit(b, filled + b.padded):
            self.flush_gradients()

    def _next_would_not_fit(self, b: Bucket, filled: int) -> bool:
        """Will the next unit to reduce (as the first backward recorded them) start a new bucket? Then this one
        can go now instead of waiting for it: the same buckets, on the wire sooner, and not held while the next
        unit's backward computes. Any other order than the recorded one: wait, as on the first backward."""
        order, k = self._grad_order, self._grad_pos
        self._grad_pos += 1
        if self._recording_grads:
            order.append(b.index)
            return False
        if k >= len(order) or order[k] != b.index:
            self._grad_pos = len(order) + 1   # not the recorded order: no more predictions in this backward
            return False
        return k + 1 == len(order) or filled + self.layout.buckets[order[k + 1]].padded > len(self._bucket)

    def flush_gradients(self) -> None:
        """Reduce-scatter the units waiting in the bucket, in one collective."""
        if self._pending:
            units, bufs = zip(*self._pending, strict=True)
            self.reduce_to_shard(list(units), list(bufs), self._bucket_slot)
            self._pending, self._bucket = [], None

    def fusing(self) -> bool:
        """Does a bucket's reduce-scatter wait to share a round with the next gather? Where both pack nothing and
        run on the comm thread (overlap_comm), in one coalesced collective each."""
        zc = self.config.zero_optimization
        return (self.fuse_backward and self.coalesce and self.overlap_comm and zc.reduce_scatter
                and self.comm.packs_nothing("reduce_scatter") and self.comm.packs_nothing("all_gather"))

    def reduce_to_shard(self, buckets: list[Bucket], bufs: list[torch.Tensor], slot: int) -> None:
        if not self.fusing():
            super().reduce_to_shard(buckets, bufs, slot)
            return
        self.send_deferred()   # one waits at a time
        self._deferred = (buckets, bufs, slot)

    def send_deferred(self) -> None:
        """The reduce-scatter that waited for a gather goes on its own."""
        if self._deferred is not None:
            buckets, bufs, slot = self._deferred
            self._deferred = None
            super().reduce_to_shard(buckets, bufs, slot)

    def _gather_and_reduce(self, part: list[Bucket], bufs: list[torch.Tensor]):
        """One job for the waiting reduce-scatter and the gather of `part`, in one round (Comm.together); both wait
        for its handle: take_bucket_slot for the bucket's slot, fetch() for the units."""
        buckets, grads, slot = self._deferred
        self._deferred = None
        outs = [self.grad_out(b) for b in buckets]

        def job() -> None:
            reduced = [torch.empty_like(out, dtype=grads[0].dtype) for out in outs]
            self.comm.together([("reduce_scatter", reduced, grads, "grads", True),
                                ("all_gather", bufs, [self.param_piece(b) for b in part], "params", False)])
            self.bucket_buffers[slot] = None   # reduced: the buffer goes
            for out, r in zip(outs, reduced, strict=True):
                out.add_(r)            # micro-steps accumulate in the shard

        handle = self.overlap(job)     # overlap_comm is on (fusing): backward's wait() waits for it too
        self._buffer_jobs[slot] = handle
        return handle

    def take_bucket_slot(self, b: Bucket | None = None) -> tuple[int, torch.Tensor]:
        self.send_deferred()   # its slot may be the one wanted
        return super().take_bucket_slot(b)

    def before_backward(self) -> None:
        super().before_backward()
        self._grad_pos = 0

    def after_backward(self) -> None:
        super().after_backward()
        self.flush_gradients()
        self.send_deferred()
        if self._recording_grads and self._grad_order:
            self._recording_grads = False   # the order units reached post_backward: the next backwards' order
        for u in list(self.inflight):       # a prefetch nobody used
            self.fetch(u)
        for u in list(self.gathered):
            self.release(u)

    # -- step -------------------------------------------------------------------------------------------
    def publish(self) -> None:
        for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
            self.write_back(b, master)
        # The units kept whole get their new values, in one collective (one each without coalescing).
        kept = [b for b in self.layout.buckets if b.index in self.persistent]
        for group in ([kept] if self.coalesce and kept else [[b] for b in kept]):
            self.comm.all_gather_coalesced([self.gathered[b.index] for b in group],
                                           [self.param_piece(b) for b in group])

    def owned(self) -> dict[str, list[torch.Tensor]]:
        base = super().owned()
        persistent = [self.gathered[u] for u in self.persistent]
        return {
            "parameters": [self.param_shard, *persistent],
            "gradients": base["gradients"],
            "master_weights": [p.data for p in self.master_pieces],
            "optimizer_state": base["optimizer_state"],
            "buckets": self.bucket_buffers,
            "gathered_parameters": [v for u, v in self.unit_buffers.items() if u not in self.persistent],
            "other": base["other"],
        }
