"""Memory over a step, in PyTorch's memory-snapshot format: live bytes by category after every operator, on every
rank, as a plot and as the dict `torch.cuda.memory._snapshot()` returns, which PyTorch's own viewer draws
(`torch.cuda._memory_viz.trace_plot(snapshot)` writes its HTML on a CPU-only torch too; the pickle opens at
https://pytorch.org/memory_viz).

`MemoryTimeline(engine)` is a TorchDispatchMode, like zeroedu.memory.PeakTracker, but it keeps the history: each
tensor storage an operator makes is an allocation (address, bytes, the engine's category for it), and a storage
that died, or that stage 3 shrank or grew in place (a released or gathered unit), is a free (and an allocation
of its new size). After every operator it records the live bytes by category. Storages the engine holds when the
block starts are the memory already there (the snapshot's blocks that precede the trace).

As in PeakTracker, a storage is labelled with the engine's category (engine.owned()) if the engine holds it,
else "activations" if made during forward and "temporaries" otherwise; ring temporaries made on the comm thread
are not seen.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeroedu.course.holdings import register_zh
from zeroedu.memory import CATEGORIES

register_zh({"Live bytes by category over one step": "一步之内各类别的存活字节数",
             "operator (forward: blue, backward: red, step: green)":
                 "算子序号（前向：蓝，反向：红，优化器步：绿）"}, [])


@dataclass
class _Block:
    addr: int
    size: int
    category: str
    born: int          # index of the sample after which it was first alive (-1: there before the block)
    time_us: int


@dataclass
class Timeline:
    """One rank's memory over the tracked block: `samples[i]` is (phase, operator, {category: bytes}) after the
    i-th operator; `events` the allocations and frees in the snapshot's own terms; `before` the blocks there
    when it started; `after` those still alive at the end."""

    rank: int
    samples: list[tuple[str, str, dict[str, int]]] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    before: list[dict] = field(default_factory=list)
    after: list[dict] = field(default_factory=list)

    def totals(self) -> list[int]:
        return [sum(by.values()) for _, _, by in self.samples]

    @property
    def peak(self) -> int:
        return max(self.totals(), default=0)

    def at_peak(self) -> tuple[str, dict[str, int]]:
        """(phase, bytes by category) at the first sample with the most live bytes."""
        totals = self.totals()
        i = totals.index(max(totals))
        return self.samples[i][0], dict(self.samples[i][2])


class MemoryTimeline(TorchDispatchMode):
    """Record live bytes by category after every operator of the enclosed code, and every allocation and free."""

    def __init__(self, engine, rank: int | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.timeline = Timeline(engine.rank if rank is None else rank)
        self._live: dict[int, tuple[StorageWeakRef, _Block]] = {}    # storage identity -> (its weak ref, block)
        self._default: dict[int, str] = {}
        self._t0 = time.perf_counter()

    # -- what the engine holds -----------------------------------------------------------------------------
    def _owned(self) -> dict[int, tuple[torch.UntypedStorage, str]]:
        out: dict[int, tuple[torch.UntypedStorage, str]] = {}
        for cat, tensors in self.engine.owned().items():
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    out.setdefault(st._cdata, (st, cat))   # first category wins, as zeroedu.memory.resident
        return out

    def _now_us(self) -> int:
        return int((time.perf_counter() - self._t0) * 1e6)

    def _alloc(self, st: torch.UntypedStorage, category: str, during: bool) -> None:
        size = st.nbytes()
        if size == 0:
            return
        block = _Block(st.data_ptr(), size, category, len(self.timeline.samples) if during else -1, self._now_us())
        self._live[st._cdata] = (StorageWeakRef(st), block)
        if during:
            self.timeline.events.append(self._event("alloc", block))
        else:
            self.timeline.before.append(self._block(block))

    def _free(self, key: int) -> None:
        _, block = self._live.pop(key)
        for action in ("free_requested", "free_completed"):
            self.timeline.events.append(self._event(action, block))

    @staticmethod
    def _frames(block: _Block) -> list[dict]:
        # The viewer shows an allocation's stack; ours says what the bytes are.
        return [{"filename": "zeroedu", "line": 0, "name": f"zeroedu {block.category}"}]

    def _event(self, action: str, block: _Block) -> dict:
        return {"action": action, "addr": block.addr, "size": block.size, "stream": 0,
                "time_us": block.time_us if action == "alloc" else self._now_us(),
                "frames": self._frames(block), "category": block.category}

    def _block(self, block: _Block) -> dict:
        return {"address": block.addr, "size": block.size, "requested_size": block.size,
                "state": "active_allocated", "frames": self._frames(block), "category": block.category}

    # -- recording -----------------------------------------------------------------------------------------
    def __enter__(self):
        for st, cat in self._owned().values():
            self._alloc(st, cat, during=False)
        self._sample("start")
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._sample("end")
        self.timeline.after = [self._block(b) for _, b in self._live.values()]
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        default = "activations" if self.engine.comm.phase == "forward" else "temporaries"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self._live:
                st = t.untyped_storage()
                self._default[st._cdata] = default
                self._alloc(st, default, during=True)
        self._sample(str(func.overloadpacket.__name__))
        return out

    def _sample(self, op: str) -> None:
        owned = self._owned()
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self._free(key)
        # the engine's storages: a category once it holds them; stage 3 resizes its units' storages in place
        for key, (st, cat) in owned.items():
            entry = self._live.get(key)
            if entry is not None and entry[1].size != st.nbytes():
                self._free(key)
                entry = None
            if entry is None and st.nbytes():
                self._alloc(st, cat, during=True)
            elif entry is not None:
                entry[1].category = cat
        by: dict[str, int] = defaultdict(int)
        for _, block in self._live.values():
            by[block.category] += block.size
        self.timeline.samples.append((self.engine.comm.phase, op, dict(by)))


# -- the snapshot ---------------------------------------------------------------------------------------------
def snapshot(timelines: list[Timeline]) -> dict:
    """The ranks' timelines as one memory snapshot (rank r is device r), in the format of
    torch.cuda.memory._snapshot(): "segments" (the blocks alive at the end, with the gaps between them) and
    "device_traces" (alloc / free_requested / free_completed events, each with addr, size and frames)."""
    ranks = max((t.rank for t in timelines), default=-1) + 1
    snap: dict = {"segments": [], "device_traces": [[] for _ in range(ranks)]}
    for tl in timelines:
        snap["device_traces"][tl.rank] = [dict(e) for e in tl.events]
        every = tl.before + tl.events
        if not every:
            continue
        low = min(e["address"] if "address" in e else e["addr"] for e in every)
        high = max((e["address"] if "address" in e else e["addr"]) + e["size"] for e in every)
        blocks, last = [], low
        for b in sorted(tl.after, key=lambda b: b["address"]):
            if b["address"] < last:      # CPU addresses: a block inside a freed range's bounds is not a gap
                continue
            if b["address"] > last:
                blocks.append({"address": last, "size": b["address"] - last, "requested_size": 0,
                               "state": "inactive", "frames": []})
            blocks.append(dict(b))
            last = b["address"] + b["size"]
        if last < high:
            blocks.append({"address": last, "size": high - last, "requested_size": 0, "state": "inactive",
                           "frames": []})
        active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        snap["segments"].append({"device": tl.rank, "address": low, "total_size": high - low, "stream": 0,
                                 "segment_type": "large", "allocated_size": active, "active_size": active,
                                 "requested_size": active, "is_expandable": False, "blocks": blocks})
    return snap


def replay_peak(snap: dict, device: int) -> int:
    """The most live bytes on one device of a snapshot, replayed from its events: the bytes alive before the trace
    (at the end, plus what was freed, less what was allocated during it), then each alloc and free in order."""
    events = snap["device_traces"][device]
    at_end = sum(b["size"] for s in snap["segments"] if s["device"] == device for b in s["blocks"]
                 if b["state"] == "active_allocated")
    allocated = sum(e["size"] for e in events if e["action"] == "alloc")
    freed = sum(e["size"] for e in events if e["action"] == "free_completed")
    live = peak = at_end - allocated + freed
    for e in events:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, live)
    return peak


def timeline_rank(rank: int, world_size: int, config, steps: int = 2, track_step: int = 1, global_batch: int = 8,
                  model_cfg=None) -> dict:
    """For zeroedu.launch: train `steps` steps; record step `track_step` with MemoryTimeline and, around it, the
    engine's own PeakTracker (engine.track_memory). Returns the Timeline and the engine's memory report."""
    import zeroedu
    from zeroedu.course.basics import build_model, one_step

    engine, *_ = zeroedu.initialize(model=build_model(model_cfg), config=dict(config))
    tl = None
    for step in range(steps):
        if step == track_step:
            with engine.track_memory(), MemoryTimeline(engine, rank) as rec:
                one_step(engine, step, global_batch, model_cfg, rank, world_size)
            tl = rec.timeline
        else:
            one_step(engine, step, global_batch, model_cfg, rank, world_size)
    if tl is None:
        raise ValueError(f"track_step={track_step} is not one of the {steps} steps run")
    return {"rank": rank, "timeline": tl, "memory": engine.memory()}


@dataclass
class MemoryRun:
    """timeline_run's result: each rank's Timeline and engine.memory() report, and the ranks' snapshot."""

    timelines: list[Timeline]
    memory: list[dict]
    snapshot: dict


def timeline_run(config, world_size: int = 2, steps: int = 2, track_step: int = 1, **launch_kw) -> MemoryRun:
    """Record one step's memory on world_size ranks (zeroedu.launch) and build the snapshot of all of them."""
    import zeroedu

    if not 0 <= track_step < steps:
        raise ValueError(f"track_step={track_step} is not one of the {steps} steps run (0 to {steps - 1}): pass "
                         f"steps > track_step")
    results = zeroedu.launch(timeline_rank, world_size=world_size, args=(dict(config), steps, track_step),
                             **launch_kw)
    tls = [r["timeline"] for r in results]
    return MemoryRun(tls, [r["memory"] for r in results], snapshot(tls))


def save_snapshot(snap: dict, path: str) -> str:
    """Write the snapshot as the pickle PyTorch's viewer opens (drag it onto https://pytorch.org/memory_viz)."""
    import pickle

    with open(path, "wb") as f:
        pickle.dump(snap, f)
    return path


def plot(timelines: list[Timeline], title: str = "Live bytes by category over one step"):
    """One panel per rank; one line per category (MB after each operator); the phases shaded."""
    import matplotlib.pyplot as plt

    from zeroedu.i18n.figures import localize

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.4 * len(timelines)), sharex=True, squeeze=False)
    colors = dict(zip(CATEGORIES, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False))
    shades = {"forward": "#e8f0fe", "backward": "#fde8e8", "step": "#e8fde8"}
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        cats = [c for c in CATEGORIES if any(by.get(c) for _, _, by in tl.samples)]
        x = range(len(tl.samples))
        for c in cats:
            ax.plot(x, [by.get(c, 0) / 1e6 for _, _, by in tl.samples], label=c.replace("_", " "), color=colors[c])
        start = 0
        for i in range(1, len(tl.samples) + 1):
            if i == len(tl.samples) or tl.samples[i][0] != tl.samples[start][0]:
                ax.axvspan(start, i, color=shades.get(tl.samples[start][0], "white"), zorder=0)
                start = i
        ax.set_ylabel(f"rank {tl.rank}: MB")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_title(title)
    axes[-1, 0].set_xlabel("operator (forward: blue, backward: red, step: green)")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    return localize(fig)
