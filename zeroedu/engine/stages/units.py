"""Stage 3's units: their states, the order the forward ran modules in, and the coordinator that moves them."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from zeroedu.engine.stages.routing import RoutingCheck


class UnitState(enum.Enum):
    """Where a unit is in its life, as FSDP2's sharded / unsharded states."""
    RELEASED = "released"     # only this rank's piece, in the shard; the parameters are empty tensors
    GATHERING = "gathering"   # an all-gather into the unit's buffer is on its way (in `inflight`)
    GATHERED = "gathered"     # whole: the parameters are views of its buffer (in `gathered`)


class ForwardTrace:
    """The order in which modules ran in the first forward, and whether the running forward follows it."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []   # module calls, in the first forward's order
        self.last_use: dict[int, int] = {}         # unit -> the last call of the forward that needs it
        self.recording = True                      # the first forward is running
        self.follows = False                       # this forward runs as recorded: release and prefetch by it
        self.open: list[int] = []                  # calls entered and not yet left (nested modules)
        self.calls = 0                             # calls entered in this forward

    def enter(self, m: torch.nn.Module) -> int:
        """Module m starts; returns its call number in this forward."""
        i = self.calls
        self.calls += 1
        self.open.append(i)
        if self.recording:
            self.modules.append(m)
        elif self.follows and (i >= len(self.modules) or self.modules[i] is not m):
            self.follows = False   # this forward runs differently: release only at the end, prefetch no more
        return i

    def leave(self) -> int:
        """The innermost running module is done; returns its call number."""
        return self.open.pop()

    def end(self, units_of: dict[torch.nn.Module, list[int]]) -> None:
        """The whole forward is done. After the first, its record becomes the order to follow."""
        if self.recording:
            self.recording, self.follows = False, True
            for j, m in enumerate(self.modules):
                for u in units_of[m]:
                    self.last_use[u] = j
        self.calls = 0


class GatherSource:
    """How units' full parameters arrive: every rank's piece (engine.param_piece: the shard, or offload's host or
    NVMe copy brought to the device) all-gathered over the world, the units of one call in one coalesced
    collective. ZeRO++ supplies another source (zeroedu.zeropp.ZeroPPSource: int8 blocks, or the node's
    secondary copy); the coordinator decides *when*, the source only *how*.
    """

    # May a gather share one round with a waiting gradient reduce-scatter (Comm.together)? Only a plain all-gather.
    fusable = True

    def __init__(self, engine) -> None:
        self.engine = engine

    def plan(self, units: list) -> list[tuple[list, Callable[[list, list[torch.Tensor]], None]]]:
        """The units grouped by where they come from, each group with the function that fills their buffers
        (it runs on the comm thread). Called on the main thread, in the order gathers start."""
        return [(units, self.gather)]

    def gather(self, units: list, bufs: list[torch.Tensor]) -> None:
        e = self.engine
        e.comm.all_gather_coalesced(bufs, [e.param_piece(b) for b in units])


class UnitCoordinator:
    """Stage 3's units, in one place: each unit's state, the forward trace, fetch, release, prefetch, the live
    limit and the reuse distance (the role of DeepSpeed's PartitionedParameterCoordinator and FSDP2's
    FSDPParamGroup).

    The state machine, one unit at a time (UnitState):

        RELEASED --start()--> GATHERING --fetch()--> GATHERED --release()--> RELEASED
        RELEASED --------------fetch()-------------> GATHERED   (no prefetch: start and wait at once)

    The state is read from where the unit is: `gathered` (unit -> its buffer, the parameters are views of it),
    `inflight` (unit -> (handle, buffer) of a gather on its way), neither (only this rank's piece). Exercise 6's
    fetch and release keep those two dicts, so they are the state itself, not a copy of it.

    *When* a unit moves is decided here (the forward and backward hooks call pre_forward, post_forward,
    pre_backward; end_backward ends a backward), through the engine's verbs fetch, release, prefetch and
    start_gathers, which a subclass may override (exercise 6 overrides fetch and release). *How* its bytes arrive
    is the source's (GatherSource). Gradients go through GradBuckets (zeroedu/engine/stages/grad_buckets.py).
    """

    def __init__(self, engine, layout, units_of: dict, persistent: set[int], prefetch_numel: int, max_live: int,
                 max_reuse_distance: int, coalesce: bool) -> None:
        self.engine, self.layout, self.units_of = engine, layout, units_of
        self.persistent, self.prefetch_numel, self.max_live = persistent, prefetch_numel, max_live
        self.max_reuse_distance, self.coalesce = max_reuse_distance, coalesce
        self.source: GatherSource = GatherSource(engine)
        self.unit_buffers: dict[int, torch.Tensor] = {}  # unit -> its full buffer (storage empty when released)
        self.gathered: dict[int, torch.Tensor] = {}      # unit -> its full buffer, while GATHERED
        self.inflight: dict[int, tuple] = {}             # unit -> (handle, buffer), while GATHERING
        self.trace = ForwardTrace()
        self.reused: set[int] = set()   # units kept gathered from forward to backward (set when the trace is done)
        self.routing = RoutingCheck(engine)

    # -- the state machine --------------------------------------------------------------------------------------
    def state(self, u: int) -> UnitState:
        if u in self.gathered:
            return UnitState.GATHERED
        return UnitState.GATHERING if u in self.inflight else UnitState.RELEASED

    def buffer(self, b) -> torch.Tensor:
        """Unit b's full-size buffer, with its storage allocated: what its all-gather fills. Each unit keeps one
        buffer for its life: autograd's saved views of a weight (nn.Linear saves weight.t()) keep pointing at
        its storage, cost nothing while it is released, and see the values gathered again for backward."""
        e = self.engine
        if b.index not in self.unit_buffers:
            self.unit_buffers[b.index] = torch.empty(b.padded, dtype=e.dtype, device=e.device)
        buf = self.unit_buffers[b.index]
        nbytes = b.padded * buf.element_size()
        if buf.untyped_storage().nbytes() != nbytes:
            buf.untyped_storage().resize_(nbytes)
        return buf

    def attach(self, b, buf: torch.Tensor) -> None:
        """-> GATHERED: the parameters become views of the unit's buffer."""
        self.gathered[b.index] = buf
        for p, view in zip(b.params, self.layout.param_views_of_bucket(buf, b), strict=True):
            p.data = view

    def detach(self, b) -> None:
        """-> RELEASED: the parameters point at an empty tensor, the buffer's storage is freed."""
        e = self.engine
        self.gathered.pop(b.index, None)
        for p in b.params:
            p.data = torch.empty(0, dtype=e.dtype, device=e.device)
        if b.index in self.unit_buffers:
            self.unit_buffers[b.index].untyped_storage().resize_(0)

    def start(self, units: list) -> None:
        """RELEASED -> GATHERING for these units, on the comm thread (the caller waits for the handle: fetch()).
        One collective per group the source plans (one per unit without coalescing). A gradient reduce-scatter
        waiting in the buckets (GradBuckets.deferred) rides along with a plain gather, in one round."""
        e = self.engine
        grads = e.grad_buckets
        for group, fill in self.source.plan(units):
            for part in [group] if self.coalesce else [[b] for b in group]:
                if not part:
                    continue
                bufs = [self.buffer(b) for b in part]
                agreed = self.routing.ask(part)   # the ranks gather the same units here? (read before the gather)
                if grads.deferred is not None and self.source.fusable:
                    handle = grads.reduce_with_gather(part, bufs, before=agreed)
                else:
                    def job(part=part, bufs=bufs, fill=fill, agreed=agreed) -> None:
                        agreed()
                        fill(part, bufs)
                    handle = e.overlap(job, prefetch=True)
                for b, buf in zip(part, bufs, strict=True):
                    self.inflight[b.index] = (handle, buf)

    def fetch(self, u: int) -> None:
        """-> GATHERED now (waiting for its prefetch if one is on the way)."""
        state = self.state(u)
        if state is UnitState.GATHERED:
            return
        if state is UnitState.RELEASED:
            self.engine.start_gathers([self.layout.buckets[u]])
        handle, buf = self.inflight.pop(u)
        handle.wait()
        self.attach(self.layout.buckets[u], buf)

    def release(self, u: int) -> None:
        """GATHERED -> RELEASED, unless the unit is persistent."""
        if self.state(u) is UnitState.GATHERED and u not in self.persistent:
            self.detach(self.layout.buckets[u])

    # -- when: prefetch, the live limit, reuse ------------------------------------------------------------------
    def live_numel(self) -> int:
        units = [u for u in (*self.gathered, *self.inflight) if u not in self.persistent]
        return sum(self.layout.buckets[u].padded for u in units)

    def prefetch(self, calls: range) -> None:
        """Start gathering the units of the next module calls in the recorded order, within the prefetch budget
        and the live limit; never a unit whose backward is over."""
        if not self.trace.follows:
            return
        done = self.engine.backward_done
        budget, live, start = self.prefetch_numel, self.live_numel(), []
        for u in dict.fromkeys(u for j in calls for u in self.units_of[self.trace.modules[j]]):
            if self.state(u) is not UnitState.RELEASED or u in done:
                continue
            n = self.layout.buckets[u].padded
            if n > budget or live + n > self.max_live:
                break
            budget, live = budget - n, live + n
            start.append(self.layout.buckets[u])
        if start:
            self.engine.start_gathers(start)

    def reused_units(self) -> set[int]:
        """The units whose backward comes within `stage3_max_reuse_distance` elements of their last forward use.

        Modules run backward in the reverse of their forward order, so what comes between call j's end and its
        backward is every call after j, twice: once in forward, once in backward."""
        sizes = [sum(self.layout.buckets[u].numel for u in self.units_of[m]) for m in self.trace.modules]
        kept, after = set(), 0
        for j in range(len(sizes) - 1, -1, -1):
            if 2 * after < self.max_reuse_distance:
                kept.update(u for u in self.units_of[self.trace.modules[j]]
                            if self.trace.last_use[u] == j and u not in self.persistent)
            after += sizes[j]
        return kept

    # -- the hooks' decisions -------------------------------------------------------------------------------------
    def pre_forward(self, m: torch.nn.Module, recomputing: bool) -> None:
        e = self.engine
        if recomputing:   # activation checkpointing runs m again in backward: gather, leave the trace alone
            self.routing.now = ("recomputed forward", m)
            for u in self.units_of[m]:
                e.fetch(u)
            return
        i = self.trace.enter(m)
        self.routing.enter(m, i, departed=not self.trace.recording and not self.trace.follows)
        for u in self.units_of[m]:
            e.fetch(u)
        if i == 0:
            e.start_forward()   # a new forward: no unit has been reduced in it yet
        e.prefetch(range(i + 1, len(self.trace.modules)))

    def post_forward(self, m: torch.nn.Module, root: torch.nn.Module) -> int:
        """Module m's forward is over: release what its call was the last use of. Returns its call number."""
        e = self.engine
        i = self.trace.leave()
        done = m is root   # the whole forward is done
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
                    e.release(u)
        if done:
            for u in list(self.gathered):
                if u not in keep:
                    e.release(u)
        return i

    def pre_backward(self, m: torch.nn.Module, i: int | None) -> None:
        e = self.engine
        self.routing.now = ("backward", m)
        for u in self.units_of[m]:
            if u not in e.backward_done:     # reduced already: this module's backward is over
                e.fetch(u)
        if i is not None:                    # None: a recomputed module, which has no place in the trace
            e.prefetch(range(i - 1, -1, -1))
        e.grad_buckets.send_deferred()       # no gather started here to take it along

    def end_backward(self) -> None:
        e = self.engine
        self.routing.now = ("end of backward", None)
        for u in list(self.inflight):        # a prefetch nobody used
            e.fetch(u)
        for u in list(self.gathered):
            e.release(u)
