"""What a launched rank tells the parent: its status slot, and the per-group collective counter.

Each rank writes what it is doing into a small shared-memory slot (`report_status`, called by the comm layer
around every collective). The parent (zeroedu.launch) reads the slots; zeroedu.launch_diagnose turns them into
errors that name mismatched collectives and hung ranks. Each collective carries its number in its group's order
(`next_collective`), so that a rank that is merely behind is told apart from one in a different collective.
torch.distributed's own collectives are wrapped in a launched rank so that they report too.
"""

from __future__ import annotations

import functools
import inspect
import json
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_SLOT_BYTES = 4096          # per rank: u32 version, u32 length, JSON status
_HISTORY = 3                # collectives remembered per group, to tell a lagging rank from a mismatched one


# -- status slots (shared memory) ---------------------------------------------------------------------------

class Slots:
    """One fixed-size slot per rank in a shared file mapping. Each slot has one writer (its rank) and one
    reader (the parent); a version counter that is odd while a write is in progress lets the reader skip
    torn reads."""

    def __init__(self, path: str, world_size: int, create: bool) -> None:
        size = world_size * _SLOT_BYTES
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        self._file = open(path, "r+b")  # lives as long as the mapping
        self._map = mmap.mmap(self._file.fileno(), size)

    def write(self, rank: int, data: bytes) -> None:
        base = rank * _SLOT_BYTES
        (version,) = struct.unpack_from("<I", self._map, base)
        struct.pack_into("<I", self._map, base, version + 1)
        struct.pack_into(f"<I{len(data)}s", self._map, base + 4, len(data), data)
        struct.pack_into("<I", self._map, base, version + 2)

    def read(self, rank: int) -> dict | None:
        base = rank * _SLOT_BYTES
        for _ in range(100):
            version, n = struct.unpack_from("<II", self._map, base)
            data = bytes(self._map[base + 8:base + 8 + n])
            if version % 2 == 0 and struct.unpack_from("<I", self._map, base)[0] == version:
                return json.loads(data) if n else None
            time.sleep(0.0001)
        return None

    def close(self) -> None:
        self._map.close()
        self._file.close()


class RankContext:
    """What this rank tells the parent: its current status and the last few collectives done per group."""

    def __init__(self, rank: int, slots: Slots) -> None:
        self.rank = rank
        self.slots = slots
        self.lock = threading.Lock()  # the comm thread and the main thread both report
        self.status = "starting"
        self.done: dict[str, list[list]] = {}  # group key -> [[seq, sig, time], ...] newest last
        self.local = threading.local()         # .inside: this thread is in a collective it reported
        self.seqs: dict[str, int] = {}         # torch.distributed's own collectives, counted per group
        # The engine's collective record since its last optimizer step (zeroedu.comm.agreement): lets the parent name
        # the rank whose sequence differs when gloo aborts on a mismatch.
        self.agreement: Callable[[], dict] | None = None

    def inside(self) -> bool:
        return getattr(self.local, "inside", False)

    def next_seq(self, key: str) -> int:
        with self.lock:
            self.seqs[key] = self.seqs.get(key, 0) + 1
            return self.seqs[key]

    def set(self, status: str) -> None:
        with self.lock:
            self.status = status
            self._write()

    def report(self, text: str | None) -> None:
        parts = text.split("|", 3) if text else []
        with self.lock:
            if text is None:
                self.status = "running"
            elif len(parts) == 4 and parts[0] in ("waiting", "done") and parts[2].lstrip("-").isdigit():
                self.local.inside = parts[0] == "waiting"
                if parts[0] == "waiting":
                    self.status = text
                else:
                    history = self.done.setdefault(parts[1], [])
                    if history and history[-1][0] == int(parts[2]):   # an async op, issued and now waited for
                        history.pop()
                    history.append([int(parts[2]), parts[3], time.time()])
                    del history[:-_HISTORY]
                    self.status = "running"
            else:
                self.status = "running: " + text
            self._write()

    def _write(self) -> None:
        state = {"s": self.status[:300], "t": time.time(), "d": self.done, "full": True}
        if self.agreement is not None:
            state["a"] = self.agreement()
        data = json.dumps(state, separators=(",", ":")).encode()
        if len(data) > _SLOT_BYTES - 8:  # many groups: keep only the newest collective of each
            state["d"] = {k: v[-1:] for k, v in self.done.items()}
            data = json.dumps(state, separators=(",", ":")).encode()
        while len(data) > _SLOT_BYTES - 8 and state["d"]:  # still too long: forget groups, and say so
            state["d"].pop(next(iter(state["d"])))
            state["full"] = False
            data = json.dumps(state, separators=(",", ":")).encode()
        self.slots.write(self.rank, data)


_CONTEXT: RankContext | None = None   # set inside a rank started by launch()


def start_reporting(rank: int, slots: Slots) -> RankContext:
    """Make this process launched rank `rank`, reporting into `slots`: called once, by the rank's entry point."""
    from zeroedu import comm

    global _CONTEXT
    _CONTEXT = RankContext(rank, slots)
    comm.observe(_CONTEXT)   # the comm layer reports each collective to it and takes its per-group count
    return _CONTEXT


def rank_context() -> RankContext | None:
    """This rank's context inside a rank started by launch(); None elsewhere."""
    return _CONTEXT


def in_launched_rank() -> bool:
    """True inside a rank process started by launch()."""
    return _CONTEXT is not None


def next_collective(key: str) -> int | None:
    """The number of this rank's next collective on the group `key` ("0,1,2,3"), counted once for zeroedu's comm
    layer and the raw torch.distributed calls watched below, or None outside launch(). One count per group means
    that rank 0 in a torch.distributed collective while rank 1 is in one of zeroedu's is seen as what it is: two
    different collectives at the same place in the group's order."""
    ctx = _CONTEXT
    return None if ctx is None else ctx.next_seq(key)


def report_status(text: str | None) -> None:
    """Tell the launcher what this rank is doing; a cheap no-op outside launch().

    The comm layer calls `report_status(f"waiting|{group_key}|{seq}|{op} {dtype}[{numel}] ({phase})")` when it
    enters a collective and the same with "done|" after it; group_key names the group by its global ranks
    ("0,1,2,3") and seq counts that group's collectives on this rank. None means "running user code"; any other
    text is shown as-is in hang reports.
    """
    ctx = _CONTEXT
    if ctx is not None:
        ctx.report(text)


# -- torch.distributed's own collectives, watched -------------------------------------------------------------

# The course (notebook 02, exercise 2) and learners call torch.distributed directly, not only through zeroedu's
# comm layer. Inside a launched rank these are wrapped so that they report to the launcher too: a mismatch or a
# hang in raw torch.distributed is then named like one in zeroedu's collectives. (torch's own checker,
# TORCH_DISTRIBUTED_DEBUG=DETAIL, would run an extra collective before every one to compare fingerprints.)
_DIST_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                     "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                     "all_to_all_single", "all_reduce_coalesced", "barrier", "monitored_barrier", "gather",
                     "scatter", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_DIST_P2P = ("send", "recv", "isend", "irecv")
_UNEVEN = {"all_to_all", "all_to_all_single"}   # ranks may pass different sizes: compare the dtype only
RAW = "torch.distributed"


def watch_torch_distributed() -> None:
    """Replace torch.distributed's collectives in this rank with versions that report to the launcher."""
    from torch.distributed import distributed_c10d as c10d

    for name in _DIST_COLLECTIVES + _DIST_P2P:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_zeroedu_watched", False):
            continue
        watched = _watched(name, fn)
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, watched)


def _watched(name: str, fn: Callable) -> Callable:
    names = list(inspect.signature(fn).parameters)
    p2p = name in _DIST_P2P

    @functools.wraps(fn)
    def call(*args, **kwargs):
        ctx = _CONTEXT
        if ctx is None or ctx.inside():   # zeroedu's comm layer (or the caller) reported this one already
            return fn(*args, **kwargs)
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        try:
            key = _raw_key(name, bound, p2p)
        except Exception:                 # a group or peer torch will refuse: let torch say what is wrong
            return fn(*args, **kwargs)
        sig = f"{RAW}.{name}{_tensors_text(name, bound)} ({_call_site()})"
        seq = ctx.next_seq(key)
        ctx.report(f"waiting|{key}|{seq}|{sig}")
        try:
            result = fn(*args, **kwargs)
        finally:
            ctx.report(f"done|{key}|{seq}|{sig}")
        if result is not None and (bound.get("async_op") or name in ("isend", "irecv")):
            return _WatchedWork(result, key, seq, sig)
        return result

    call._zeroedu_watched = True
    return call


def _raw_key(name: str, bound: dict, p2p: bool) -> str:
    group = bound.get("group")
    if not p2p:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return ",".join(map(str, ranks))   # the key zeroedu's comm layer uses: one order per group
    peer = bound.get("dst") if name in ("send", "isend") else bound.get("src")
    if peer is None:
        return f"p2p ({RAW})"           # recv from any rank
    me = dist.get_rank()
    return f"{min(me, peer)},{max(me, peer)} (p2p)"


def _tensors_text(name: str, bound: dict) -> str:
    for value in bound.values():
        t = value[0] if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor) else value
        if isinstance(t, torch.Tensor):
            dtype = str(t.dtype).removeprefix("torch.")
            many = f"{len(value)} x " if t is not value else ""
            return f" {many}{dtype}" if name in _UNEVEN else f" {many}{dtype}[{t.numel()}]"
    return ""


def _call_site() -> str:
    """The line that called the collective: the first frame outside torch and zeroedu (and the zeroedu module
    in between, if any), e.g. "at train.py:12" or "at train.py:30 via zeroedu.checkpoint"."""
    frame, via = sys._getframe(2), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".", 1)[0] not in ("torch", "zeroedu"):
            break
        if module.startswith("zeroedu") and not _is_launch(module) and via is None:
            via = module   # the innermost: the zeroedu module that ran the collective
        frame = frame.f_back
    if frame is None:
        return f"in {via}" if via else "at an unknown line"
    where = f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return f"{where} via {via}" if via else where


def _is_launch(module: str) -> bool:
    """zeroedu.launch or one of its parts (zeroedu.launch.status, ...): the machinery, never what a collective
    is "via"."""
    return module == "zeroedu.launch" or module.startswith("zeroedu.launch.")


class _WatchedWork:
    """The Work of an asynchronous torch.distributed call: waiting on it is reported, as a blocking call is."""

    def __init__(self, work: Any, key: str, seq: int, sig: str) -> None:
        self._work, self._key, self._seq, self._sig = work, key, seq, sig

    def wait(self, *args, **kwargs):
        ctx = _CONTEXT
        if ctx is None or ctx.inside():
            return self._work.wait(*args, **kwargs)
        ctx.report(f"waiting|{self._key}|{self._seq}|{self._sig}")
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            ctx.report(f"done|{self._key}|{self._seq}|{self._sig}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
