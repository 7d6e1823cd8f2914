"""Start N ranks from a notebook cell, a script or torchrun; bring their results back; surface failures.

`launch(fn, world_size)` runs `fn(rank, world_size, *args, **kwargs)` in `world_size` processes that share one
torch.distributed process group, and returns what each rank returned, as a list indexed by rank. Under torchrun
(RANK and WORLD_SIZE already in the environment) it runs fn in this process and gathers the results instead, so
the same script works on one laptop and on several nodes.

Why it is built this way:
- fn travels by value (cloudpickle), so a function defined in a notebook cell or in `__main__` works;
  torch.multiprocessing.spawn pickles such functions by reference and fails.
- Ranks are forked from a multiprocessing forkserver that has already imported torch. A fresh interpreter
  spends ~2 s importing torch, which "spawn" pays for every rank of every launch; the forkserver pays it once
  per notebook kernel. The forkserver is a fresh single-threaded process, so the kernel itself (threads, CUDA)
  is never forked.
- The rendezvous store lives in the parent, on a socket the parent bound to 127.0.0.1 itself: nothing listens
  beyond loopback and there is no race for a free port. Gloo is pinned to the loopback interface too.
- Each rank writes what it is doing into a small shared-memory slot (`report_status`, called by the comm layer
  around every collective). The parent watches the slots and turns mismatched collectives and hangs into errors
  that name the ranks, with every rank's Python stack (faulthandler), instead of a notebook cell that never ends.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import functools
import inspect
import io
import json
import linecache
import mmap
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
from collections import ChainMap
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import cloudpickle
import torch
import torch.distributed as dist

from zeroedu.sysinfo import available_memory

__all__ = ["CollectiveMismatchError", "LaunchError", "LaunchTimeoutError", "RankError", "RankHangError",
           "in_launched_rank", "init_distributed", "launch", "report_status"]

MEMORY_PER_RANK_GB = 0.5    # rough resident size of one rank process (torch + gloo + a tiny model)
START_TIMEOUT = 60.0        # seconds for every rank to start and join the process group
MISMATCH_SECONDS = 1.0      # two ranks stuck in different collectives this long: a mismatch, not a lag
KILL_GRACE = 3.0            # seconds between SIGTERM and SIGKILL when stopping ranks (their exit handlers run)
STACK_WAIT = 0.5            # seconds to wait for faulthandler stack dumps
POLL = 0.1                  # seconds between looks at the status slots
PG_TIMEOUT = 1800.0         # torch's default limit on one collective (30 min), kept unless ours need more
# forkserver where the platform has it (Linux, macOS); ZEROEDU_START_METHOD=spawn to compare.
START_METHOD = os.environ.get("ZEROEDU_START_METHOD") or (
    "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")

_SLOT_BYTES = 4096          # per rank: u32 version, u32 length, JSON status
_HISTORY = 3                # collectives remembered per group, to tell a lagging rank from a mismatched one
_TAIL_LINES = 30
_P2P_OPS = {"send", "recv", "isend", "irecv"}  # point-to-point: ranks legitimately run different ops
_RUN_DIR_PREFIX = "zeroedu-launch-"
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


# -- errors -------------------------------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """launch() could not start the ranks, or a rank failed, hung, or called mismatched collectives."""


class RankError(LaunchError):
    """A rank raised an exception or died; `.rank` is that rank, `.traceback` its traceback text."""

    def __init__(self, message: str, rank: int, traceback: str = "", exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exitcode = exitcode


class CollectiveMismatchError(LaunchError):
    """Ranks of one group wait in different collectives (or one left): the program would deadlock."""

    def __init__(self, message: str, statuses: dict[int, str]) -> None:
        super().__init__(message)
        self.statuses = statuses


class RankHangError(LaunchError):
    """A rank waited in a collective longer than hang_timeout."""

    def __init__(self, message: str, statuses: dict[int, str], stacks: dict[int, str], culprits: list[int]) -> None:
        super().__init__(message)
        self.statuses = statuses
        self.stacks = stacks
        self.culprits = culprits


class LaunchTimeoutError(RankHangError):
    """launch() ran longer than the `timeout` it was given and stopped the ranks: a limit, not a diagnosis. (A
    RankHangError subclass only so that code catching the old error for both keeps working; its message says
    which it is, and it blames no rank.)"""

    def __init__(self, message: str, statuses: dict[int, str], stacks: dict[int, str]) -> None:
        super().__init__(message, statuses, stacks, [])


# -- shipping functions by value ---------------------------------------------------------------------------

_CLOUDPICKLE_CODE_REDUCE = getattr(cloudpickle.Pickler, "_dispatch_table", {}).get(types.CodeType)


def _code_reduce(code: types.CodeType) -> tuple:
    make, args = _CLOUDPICKLE_CODE_REDUCE(code)
    return make, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects keep their file name (cloudpickle >= 3.1 writes "<dynamic-code>"),
    so tracebacks and stacks from the ranks point at the notebook cell or script line that fn came from."""

    if _CLOUDPICKLE_CODE_REDUCE is not None:
        dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


# -- status slots (shared memory) ---------------------------------------------------------------------------

class _Slots:
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


class _RankContext:
    """What this rank tells the parent: its current status and the last few collectives done per group."""

    def __init__(self, rank: int, slots: _Slots) -> None:
        self.rank = rank
        self.slots = slots
        self.lock = threading.Lock()  # the comm thread and the main thread both report
        self.status = "starting"
        self.done: dict[str, list[list]] = {}  # group key -> [[seq, sig, time], ...] newest last
        self.local = threading.local()         # .inside: this thread is in a collective it reported
        self.seqs: dict[str, int] = {}         # torch.distributed's own collectives, counted per group

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
        data = json.dumps(state, separators=(",", ":")).encode()
        if len(data) > _SLOT_BYTES - 8:  # many groups: keep only the newest collective of each
            state["d"] = {k: v[-1:] for k, v in self.done.items()}
            data = json.dumps(state, separators=(",", ":")).encode()
        while len(data) > _SLOT_BYTES - 8 and state["d"]:  # still too long: forget groups, and say so
            state["d"].pop(next(iter(state["d"])))
            state["full"] = False
            data = json.dumps(state, separators=(",", ":")).encode()
        self.slots.write(self.rank, data)


_CONTEXT: _RankContext | None = None   # set inside a rank started by launch()
_SINGLE_STORE: dist.TCPStore | None = None     # keeps init_distributed's loopback store alive


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
_RAW = "torch.distributed"


def _watch_torch_distributed() -> None:
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
        sig = f"{_RAW}.{name}{_tensors_text(name, bound)} ({_call_site()})"
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
        return f"p2p ({_RAW})"           # recv from any rank
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
        if module.startswith("zeroedu") and module != __name__ and via is None:
            via = module   # the innermost: the zeroedu module that ran the collective
        frame = frame.f_back
    if frame is None:
        return f"in {via}" if via else "at an unknown line"
    where = f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return f"{where} via {via}" if via else where


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


# -- what the parent reads from the slots --------------------------------------------------------------------

class _View:
    """One rank as the parent sees it: its slot and whether its process is alive or returned."""

    def __init__(self, rank: int, state: dict | None, returned: bool, exitcode: int | None) -> None:
        self.rank = rank
        self.state = state
        self.returned = returned
        self.exitcode = exitcode
        self.waiting: tuple[str, int, str] | None = None
        if state is not None and state["s"].startswith("waiting|"):
            _, key, seq, sig = state["s"].split("|", 3)
            self.waiting = (key, int(seq), sig)

    def waited(self, now: float) -> float:
        return now - self.state["t"] if self.waiting else 0.0

    def history(self, key: str) -> list[list]:
        return (self.state or {}).get("d", {}).get(key, [])

    def knows_all_groups(self) -> bool:
        return bool((self.state or {}).get("full", True))


# torch.distributed's names for what zeroedu's comm layer calls all_gather and reduce_scatter
_RAW_AS = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


def _same(sig_a: str, sig_b: str) -> bool:
    """Same collective: op, dtype and numel agree (the phase is only a label). A raw torch.distributed call
    against one of zeroedu's comm layer is compared by op alone: the two describe sizes differently."""
    if sig_a.startswith(_RAW + ".") != sig_b.startswith(_RAW + "."):
        return _RAW_AS.get(_op(sig_a), _op(sig_a)) == _RAW_AS.get(_op(sig_b), _op(sig_b))
    return sig_a.rsplit(" (", 1)[0] == sig_b.rsplit(" (", 1)[0]


def _op(sig: str) -> str:
    return sig.split(" ", 1)[0].rsplit(".", 1)[-1]


def _members(key: str, views: list[_View]) -> list[int]:
    """Global ranks of a group: from its key "0,1,2,3" (point-to-point: "0,1 (p2p)"),
    else every rank that ever used that key."""
    try:
        return [int(r) for r in key.split(" ", 1)[0].split(",")]
    except ValueError:
        return [v.rank for v in views if v.history(key) or (v.waiting and v.waiting[0] == key)]


def _describe(v: _View, now: float) -> str:
    if v.state is None:
        text = "not started (its process has not reached zeroedu's rank entry point)"
    elif v.waiting:
        key, seq, sig = v.waiting
        text = f"waiting in {sig}, collective #{seq} of group {key}, for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "starting":
        text = f"starting: loading fn and its arguments for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "joining":
        text = f"joining the process group (it waits for every rank) for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "returned" or v.returned:
        text = "returned from fn"
    else:
        note = v.state["s"].removeprefix("running").removeprefix(": ")
        text = f"running user code, not in a collective, for {now - v.state['t']:.1f} s" + (
            f" ({note})" if note else "")
    done = [(h[2], key, h[0], h[1]) for key, hist in (v.state or {}).get("d", {}).items() for h in hist[-1:]]
    if done:
        _, key, seq, sig = max(done)
        text += f"; last collective done: {sig}, #{seq} of group {key}"
    elif v.state is not None:
        text += "; no collective done yet"
    if v.exitcode is not None and not v.returned:
        text += f"; process exited ({_exit_text(v.exitcode)})"
    return text


def _find_mismatch(views: list[_View], now: float) -> str | None:
    """Return why ranks can never meet, or None. Only definite cases: the seq counters let us tell a rank that
    is merely behind (it will finish the collective the others already did) from one in a different one."""
    waiters = [v for v in views if v.waiting and v.waited(now) >= MISMATCH_SECONDS]
    for a in waiters:
        key, seq, sig = a.waiting
        if _op(sig) in _P2P_OPS:
            continue
        for b in waiters:
            if b.rank == a.rank or b.waiting[0] != key or _op(b.waiting[2]) in _P2P_OPS:
                continue
            b_seq, b_sig = b.waiting[1:]
            if b_seq == seq and not _same(sig, b_sig) and a.rank < b.rank:
                return f"ranks {a.rank} and {b.rank} are both at collective #{seq} of group {key}, but rank " \
                       f"{a.rank} is in {sig} and rank {b.rank} in {b_sig}"
            if b_seq > seq:  # b is ahead: what did b run as collective #seq?
                ran = [h[1] for h in b.history(key) if h[0] == seq]
                if ran and not _same(ran[0], sig):
                    return f"rank {a.rank} waits in {sig} as collective #{seq} of group {key}, but rank " \
                           f"{b.rank} ran {ran[0]} as #{seq} and has moved on to {b_sig} (#{b_seq})"
        for m in _members(key, views):
            left = views[m] if 0 <= m < len(views) else None
            if left is None or m == a.rank or not (left.returned or left.state and left.state["s"] == "returned"):
                continue
            history = left.history(key)
            last = history[-1][0] if history else 0
            ran = [h[1] for h in history if h[0] == seq]
            if ran and not _same(ran[0], sig):
                return f"rank {a.rank} waits in {sig} as collective #{seq} of group {key}, but rank {m} ran " \
                       f"{ran[0]} as #{seq} and then returned from fn"
            if last < seq and (history or left.knows_all_groups()):
                done = f"its last collective on that group was #{last} {history[-1][1]}" if history else \
                    "it never ran a collective on that group"
                return f"rank {m} returned from fn while rank {a.rank} waits in {sig}, collective #{seq} of " \
                       f"group {key}, which contains rank {m} ({done})"
    return None


def _holdouts(views: list[_View]) -> dict[int, str]:
    """Ranks that keep a waiting rank waiting: members of its group that are not in the same collective."""
    culprits: dict[int, str] = {}
    for a in views:
        if not a.waiting:
            continue
        key, seq, sig = a.waiting
        for m in _members(key, views):
            if m == a.rank or not 0 <= m < len(views) or m in culprits:
                continue
            b = views[m]
            if b.waiting and b.waiting[0] == key and b.waiting[1] == seq and _same(b.waiting[2], sig):
                continue
            if b.waiting:
                why = f"it waits in {b.waiting[2]} (#{b.waiting[1]} of group {b.waiting[0]}) instead"
            elif b.state is None or b.state["s"] in ("starting", "joining"):
                why = "it never joined the process group"
            elif b.returned or b.state["s"] == "returned":
                why = "it returned from fn"
            else:
                why = "it is running user code, not in any collective"
            culprits[m] = f"rank {a.rank} waits for it in {sig} (#{seq} of group {key}); {why}"
    return culprits


# -- text helpers --------------------------------------------------------------------------------------------

_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+)(,?) in ')


def _with_source(text: str) -> str:
    """Add source lines to traceback/faulthandler frames from the parent's linecache. faulthandler prints no
    source at all, and a rank has no source for functions defined in notebook cells, but the kernel does."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        m = _FRAME.match(line)
        if not m:
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m.group(4) and nxt.startswith(m.group(1) + "  ") and not _FRAME.match(nxt):
            continue  # a traceback frame that already shows its source
        src = linecache.getline(m.group(2), int(m.group(3))).strip()
        if src:
            out.append(f"{m.group(1)}    {src}")
    return "\n".join(out)


def _trim_stack(text: str) -> str:
    """A faulthandler dump without launch's own machinery: drop the thread that watches the parent, and the
    multiprocessing bootstrap frames below _rank_main (faulthandler prints the most recent call first)."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "in _watch_parent" in block or "in _wait_for_stop_signal" in block:
            continue
        lines = block.splitlines()
        cut = next((i for i, line in enumerate(lines) if line.endswith(" in _rank_main")), None)
        blocks.append("\n".join(lines if cut is None else lines[:cut + 1]))
    return "\n\n".join(blocks)


# How a C++ exception that aborts a rank (gloo's "Is there a distributed collective mismatch in your code?") starts
# its message: printed before the stack dump that fills the tail.
_ABORT_LINES = ("terminate called after throwing", "  what():", "Fatal Python error")


def _tail(path: str, n: int = _TAIL_LINES) -> str:
    """The last n lines of a rank's stderr, after the lines that say why the process aborted, if any."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    cause = [line for line in lines[:-n] if line.startswith(_ABORT_LINES)]
    return "\n".join(cause + ["..."] * bool(cause) + lines[-n:])


def _exit_text(code: int, pid: int | None = None) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {"SIGKILL": " (the kernel's out-of-memory killer, a user or a job scheduler)",
            "SIGTERM": " (a user, a job scheduler or a container runtime asked it to stop)",
            "SIGSEGV": " -- a crash in native code", "SIGBUS": " -- a crash in native code"}.get(name, "")
    if name == "SIGKILL" and pid is not None:
        line = _kernel_kill_line(_kernel_log(), pid)
        hint += (f". The kernel log says: {line!r} -- out of memory: try a smaller model or world_size" if line else
                 ". The kernel log has no out-of-memory entry for it (or cannot be read here: `dmesg` shows it)")
    return f"killed by {name}{hint}"


def _kernel_log() -> list[str]:
    """The kernel's log lines, newest last, where this user may read them (/dev/kmsg); else []."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    lines = []
    try:
        while True:
            try:
                record = os.read(fd, 8192)   # one record per read
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == 32:            # EPIPE: overwritten while we read; the next read goes on
                    continue
                break
            if not record:
                break
            lines.append(record.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


def _kernel_kill_line(lines: list[str], pid: int) -> str | None:
    """The out-of-memory killer's line about `pid` (mm/oom_kill.c: "Out of memory: Killed process PID (comm)
    ..." or "Memory cgroup out of memory: Killed process PID ..."), the newest if several."""
    pattern = re.compile(rf"Killed process {pid}\b")
    found = [line.strip() for line in lines if pattern.search(line)]
    return found[-1] if found else None


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# -- checks before anything starts ---------------------------------------------------------------------------

def _check_world_size(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _choose_backend(backend: str, local_ranks: int) -> str:
    """'auto' is NCCL when this machine has a GPU for every local rank, else gloo."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    gpus = _gpus()
    if backend == "auto":
        return "nccl" if gpus >= local_ranks else "gloo"
    if backend == "nccl" and gpus < local_ranks:
        fix = f"Use world_size <= {gpus} or backend='gloo' (CPU)." if gpus else "Use backend='gloo' (CPU)."
        raise LaunchError(f"backend='nccl' needs one GPU per rank: {local_ranks} rank(s) on this machine but "
                          f"{gpus} GPU(s) visible. {fix}")
    return backend


def _check_memory(world_size: int) -> None:
    available = available_memory()
    need = world_size * MEMORY_PER_RANK_GB * 2**30
    if available is not None and need > available:
        fits = max(1, int(available // (MEMORY_PER_RANK_GB * 2**30)))
        raise LaunchError(
            f"world_size={world_size} is more ranks than this machine can start: each rank is a process of "
            f"about {MEMORY_PER_RANK_GB} GB (an estimate), {need / 2**30:.0f} GB in all, but only "
            f"{available / 2**30:.1f} GB is available (MemAvailable in /proc/meminfo, else the physical "
            f"memory). Use world_size <= {fits}; "
            "for more ranks use several machines with torchrun.")


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), "lo")


# -- the rank process ----------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphans when a notebook kernel dies)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _watch_parent(conn: Connection, release: threading.Event) -> None:
    """The parent holds the other end of conn: EOF means it died (the forkserver, our OS-level parent, may
    outlive it), so exit. A "release" message means every rank returned and this one may leave."""
    try:
        if conn.recv() == "release":
            release.set()
            return
    except (EOFError, OSError):
        pass
    _run_exit_handlers(2.0)
    os._exit(1)


def _exit_cleanly_on_stop_signals() -> None:
    """SIGTERM, SIGINT or SIGHUP (launch stopping this rank, a user, a job scheduler): run the exit handlers (an
    engine's NVMe swap folder is deleted there), then die of that signal. The signals are blocked in every
    thread and taken by one thread with sigwait: a Python signal handler runs only in the main thread, which
    may be blocked in a collective for as long as the hang lasts. Call it before any other thread starts, so
    that every thread inherits the mask."""
    if not hasattr(signal, "pthread_sigmask"):
        return
    stop = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # all three now end the process once unblocked
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)

    def _wait_for_stop_signal() -> None:
        sig = signal.sigwait(stop)
        _run_exit_handlers(max(0.5, KILL_GRACE - 1.0))
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})   # this thread only: the signal lands here
        os.kill(os.getpid(), sig)

    threading.Thread(target=_wait_for_stop_signal, name="zeroedu-stop-signals", daemon=True).start()


def _rank_main(rank: int, world_size: int, port: int, backend: str, conn: Connection, run_dir: str,
               payload: bytes, env: dict[str, str], sys_path: list[str], cwd: str, pg_timeout: float | None,
               start_timeout: float) -> None:
    global _CONTEXT
    _die_with_parent()
    _exit_cleanly_on_stop_signals()
    _capture_output(run_dir, rank)
    _adopt_parent_environment(rank, world_size, port, env, sys_path, cwd)
    release = threading.Event()
    threading.Thread(target=_watch_parent, args=(conn, release), name="zeroedu-parent-watch", daemon=True).start()
    _CONTEXT = _RankContext(rank, _Slots(os.path.join(run_dir, "status"), world_size, create=False))
    _CONTEXT.set("starting")
    _watch_torch_distributed()   # before fn arrives: fn may hold torch.distributed's functions themselves
    try:   # inline, so fn's frame sits right below this one: a crash's stack stays short enough for the stderr tail
        fn, args, kwargs = cloudpickle.loads(payload)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # 4 ranks on 2 cores: 1 thread each
        if backend == "nccl":
            torch.cuda.set_device(rank)
        _CONTEXT.set("joining")
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=start_timeout))
        kw = {"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kw)
        _CONTEXT.set("running")
        result = fn(rank, world_size, *args, **kwargs)
        try:
            data = _dumps(result)
        except Exception as e:
            raise TypeError(f"the return value of fn ({type(result).__name__}) cannot be pickled to send it back "
                            f"to the parent: {e}. Return plain data: numbers, lists, dicts, CPU tensors.") from e
    except BaseException as e:
        _send_error_and_exit(conn, e)
    _CONTEXT.set("returned")
    conn.send(("ok", time.time(), data))
    release.wait()  # stay until every rank returned: no rank leaves a collective its peers are still finishing
    dist.destroy_process_group()
    _run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_STACK_FILE = None   # a rank's faulthandler file for SIGUSR1 stack dumps: open until the rank exits


def _capture_output(run_dir: str, rank: int) -> None:
    """The rank's stdout and stderr into files of the run's folder, at the file-descriptor level so that gloo's
    C++ messages land there too; a Python stack on a segfault, and on SIGUSR1 into rank<N>.stack."""
    global _STACK_FILE
    for fd, name in ((1, "stdout"), (2, "stderr")):
        log = os.open(os.path.join(run_dir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, fd)
        os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults print a Python stack
    _STACK_FILE = open(os.path.join(run_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)


def _adopt_parent_environment(rank: int, world_size: int, port: int, env: dict[str, str], sys_path: list[str],
                              cwd: str) -> None:
    """The forkserver was started earlier, with the environment of that moment: take the parent's current one,
    plus torch.distributed's variables for this rank."""
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())  # gloo listens on loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback_interface())
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass


def _send_error_and_exit(conn: Connection, e: BaseException) -> NoReturn:
    """Tell the parent what fn (or joining the group) raised, with a traceback that starts in fn, and exit."""
    tb = e.__traceback__
    if tb is not None and tb.tb_frame.f_code is _rank_main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next  # the traceback starts in fn, not in this wrapper
    text = "".join(traceback.format_exception(type(e), e, tb))
    _run_exit_handlers()   # before the parent stops every rank on hearing of the error
    sys.stderr.flush()
    try:
        conn.send(("error", time.time(), type(e).__name__, str(e), text))
    except OSError:
        pass
    sys.stdout.flush()
    os._exit(1)


_EXIT_LOCK = threading.Lock()
_EXIT_WORKER: threading.Thread | None = None


def _run_exit_handlers(limit: float = 10.0) -> None:
    """What a normal exit runs and os._exit skips: atexit handlers, weakref finalizers among them (an engine's
    NVMe swap folder is deleted there, zeroedu.offload). On a side thread, so one that hangs cannot keep the rank
    alive past `limit` seconds. The handlers run once: a second caller (a stop signal arriving while the error
    path runs them) waits for the same run instead of finding the list already emptied and exiting mid-way."""
    global _EXIT_WORKER
    with _EXIT_LOCK:
        if _EXIT_WORKER is None:
            _EXIT_WORKER = threading.Thread(target=atexit._run_exitfuncs, name="zeroedu-exit-handlers",
                                            daemon=True)
            _EXIT_WORKER.start()
        worker = _EXIT_WORKER
    worker.join(limit)


# What the forkserver imports once, so that no rank pays for it: torch, and torch._dynamo, which the first
# optimizer a rank builds imports (800-odd modules, seconds a rank: docs/benchmarks.md).
FORKSERVER_PRELOAD = ["torch", "torch._dynamo"]


# -- the parent ----------------------------------------------------------------------------------------------

def _process_identity(pid: int) -> str:
    """"PID START": START is when the process started (Linux: clock ticks after boot, /proc/PID/stat), so that
    a new process that got the same pid is not taken for the old one. Empty if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid} {f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except OSError:
        pass   # alive, another user's
    return f"{pid} ?"


def _remove_stale_run_dirs() -> list[str]:
    """Delete the folders of launches whose process is gone (killed by SIGKILL, which no cleanup survives), and
    say so on stderr. A folder without an owner file (being created, or from an older zeroedu) is left alone."""
    root = tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(_RUN_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "owner")) as f:
                owner = f.read().strip()
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue
        now = _process_identity(pid)
        if now and (now == owner or now.endswith(" ?") or owner.endswith(" ?")):
            continue                        # its launch is still running
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
                   if os.path.isfile(os.path.join(d, f)))
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            print(f"zeroedu launch: removed {path} ({size:,} bytes), left by a launch whose process (pid {pid}) "
                  "was killed before it could clean up", file=sys.stderr, flush=True)
    return removed


class _Stopped(BaseException):
    """SIGTERM or SIGHUP arrived while launch() ran: unwinds it like KeyboardInterrupt, so that it cleans up."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _StopSignals:
    """While a launch runs in the main thread, SIGTERM and SIGHUP stop it the way Ctrl-C does: the ranks are
    stopped (their exit handlers run) and the run folder is removed. Then the signal does what it would have
    done: with the default action the process dies of it, a handler of the program's own is called."""

    def __enter__(self) -> _StopSignals:
        self.old: dict[int, Any] = {}
        self.caught: int | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in _STOP_SIGNALS:
                old = signal.getsignal(sig)
                if old not in (signal.SIG_IGN, None):   # nohup's SIGHUP stays ignored
                    self.old[sig] = old
                    signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.caught is None:   # a second one during cleanup must not cut the cleanup short
            self.caught = signum
            raise _Stopped(signum)

    def __exit__(self, kind, error, tb) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)
        if not isinstance(error, _Stopped):
            return
        old = self.old[error.signum]
        if old is signal.SIG_DFL:
            os.kill(os.getpid(), error.signum)   # dies of it now that the ranks and the folder are gone
            time.sleep(1)
        elif callable(old):
            old(error.signum, None)
        raise LaunchError(f"launch() was stopped by {signal.Signals(error.signum).name}; the ranks were stopped "
                          "and their folder removed.") from None


class _main_without_a_file:
    """multiprocessing re-runs the parent's __main__ file in every child. `python - <<EOF` (and an interactive
    session) has a __main__ whose file, "<stdin>", does not exist, and every rank died trying to read it. fn
    and its arguments travel by value (cloudpickle), so a rank needs nothing from such a __main__: hide its
    file name while the ranks start."""

    def __enter__(self) -> None:
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        self.main, self.path = None, None
        if main is not None and isinstance(path, str) and getattr(main, "__spec__", None) is None and \
                not os.path.isfile(path):
            self.main, self.path = main, path
            del main.__file__

    def __exit__(self, *exc) -> None:
        if self.main is not None:
            self.main.__file__ = self.path


def _mp_context() -> mp.context.BaseContext:
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # only takes effect when the forkserver starts
    return ctx


class _Run:
    """One launch: start the ranks, watch them, collect results or raise, and always clean up."""

    def __init__(self, fn: Callable, world_size: int, payload: bytes, backend: str, timeout: float | None,
                 hang_timeout: float | None) -> None:
        self.fn_name = getattr(fn, "__qualname__", repr(fn))
        self.world_size = world_size
        self.payload = payload
        self.backend = backend
        self.timeout = timeout
        self.hang_timeout = hang_timeout
        self.procs: list = []
        self.conns: list[Connection] = []

    def run(self) -> list:
        _remove_stale_run_dirs()
        with _StopSignals():
            return self._run()

    def _run(self) -> list:
        self.dir = tempfile.mkdtemp(prefix=_RUN_DIR_PREFIX)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        slots = None
        try:
            with open(os.path.join(self.dir, "owner"), "w") as f:   # for the next launch, should this one be killed
                f.write(_process_identity(os.getpid()))
            sock.bind(("127.0.0.1", 0))
            sock.listen(self.world_size + 8)
            port = sock.getsockname()[1]
            # The rendezvous store, on the socket bound above: loopback only, and the port is already ours.
            # The store takes ownership of the file descriptor and closes it: detach it from `sock`.
            self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                       master_listen_fd=sock.detach())
            self.slots = slots = _Slots(os.path.join(self.dir, "status"), self.world_size, create=True)
            self._start(port)
            return self._monitor()
        except (KeyboardInterrupt, _Stopped):
            self._say_where_on_interrupt()
            raise
        finally:
            self._stop()
            for c in self.conns:
                c.close()
            if slots is not None:
                slots.close()
            self.store = None
            sock.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _start(self, port: int) -> None:
        ctx = _mp_context()
        start_timeout = min(START_TIMEOUT, self.timeout or START_TIMEOUT)
        # torch's own limit on one collective stays above both of ours, so that ours are the ones that speak
        pg_timeout = max([PG_TIMEOUT, *(t + START_TIMEOUT for t in (self.timeout, self.hang_timeout) if t)])
        env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
        self.t0 = time.time()
        with _main_without_a_file():
            self._start_ranks(ctx, port, env, path, cwd, pg_timeout, start_timeout)

    def _start_ranks(self, ctx, port, env, path, cwd, pg_timeout, start_timeout) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_rank_main, name=f"zeroedu-rank{rank}", args=(
                rank, self.world_size, port, self.backend, child_end, self.dir, self.payload, env, path, cwd,
                pg_timeout, start_timeout))
            try:
                p.start()
            except Exception as e:
                raise LaunchError(f"could not start rank {rank}: {type(e).__name__}: {e}") from e
            finally:
                child_end.close()
            self.procs.append(p)
            self.conns.append(parent_end)

    def _stop(self) -> None:
        """SIGTERM every rank still alive, SIGKILL after a short grace, and reap them all."""
        alive = [p for p in self.procs if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + KILL_GRACE
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
            p.join(5)

    def _views(self, results: dict) -> list[_View]:
        return [_View(r, self.slots.read(r), r in results, self.procs[r].exitcode) for r in range(self.world_size)]

    def _monitor(self) -> list:
        results: dict[int, bytes] = {}
        open_conns = dict(enumerate(self.conns))
        alive = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(results) < self.world_size:
            ready = set(wait(list(open_conns.values()) + list(alive), timeout=POLL))
            errors, died = [], []
            for rank, conn in list(open_conns.items()):
                if conn not in ready and self.procs[rank].sentinel not in ready:
                    continue
                try:
                    while conn.poll():
                        msg = conn.recv()
                        if msg[0] == "ok":
                            results[rank] = msg[2]
                        else:
                            errors.append((msg[1], rank, msg))
                except (EOFError, OSError):
                    del open_conns[rank]
            for sentinel in ready & set(alive):
                rank = alive.pop(sentinel)
                self.procs[rank].join(0)
                if rank not in results and not any(e[1] == rank for e in errors):
                    died.append(rank)
            if errors:  # the first to fail is the cause; later errors are usually peers losing it
                _, rank, (_, _, exc_type, exc_msg, tb) = min(errors)
                raise self._rank_error(rank, exc_type, exc_msg, tb)
            if died:
                raise self._died_error(died[0])
            if len(results) < self.world_size:
                self._check(results)
        for conn in self.conns:
            try:
                conn.send("release")
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        out = []
        for rank in range(self.world_size):
            try:
                out.append(cloudpickle.loads(results[rank]))
            except Exception as e:
                raise LaunchError(f"rank {rank} returned a value this process cannot unpickle: "
                                  f"{type(e).__name__}: {e}") from e
        return out

    # -- failures --
    def _stderr(self, rank: int) -> str:
        tail = _tail(os.path.join(self.dir, f"rank{rank}.stderr"))
        return f"\n\nLast lines of rank {rank}'s stderr:\n{_indent(tail)}" if tail.strip() else ""

    def _rank_error(self, rank: int, exc_type: str, exc_msg: str, tb: str) -> RankError:
        tb = _with_source(tb)
        msg = (f"rank {rank} of {self.world_size} raised {exc_type}: {exc_msg}\n\n"
               f"Traceback from rank {rank}:\n{tb.rstrip()}{self._stderr(rank)}\n\n"
               f"The other ranks were stopped.")
        return RankError(msg, rank, tb)

    def _died_error(self, rank: int) -> RankError:
        code = self.procs[rank].exitcode
        state = self.slots.read(rank)
        hint = ""
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        if state is None and main_file and os.path.isfile(main_file):
            hint = (f"\nIt died before reaching zeroedu's rank entry point, while multiprocessing ran {main_file} "
                    "in it: every rank runs the parent's script first. Put the script's launch() call under "
                    "`if __name__ == \"__main__\":`.")
        elif state is None:
            hint = "\nIt died before reaching zeroedu's rank entry point (see its stderr below)."
        msg = (f"rank {rank} of {self.world_size} died without raising an exception: "
               f"{_exit_text(code, self.procs[rank].pid)}."
               f"{hint}{self._stderr(rank)}\n\nThe other ranks were stopped.")
        return RankError(msg, rank, "", code)

    def _check(self, results: dict) -> None:
        now = time.time()
        views = self._views(results)
        not_joined = [v.rank for v in views if v.state is None or v.state["s"] in ("starting", "joining")]
        if not_joined and now - self.t0 > min(START_TIMEOUT, self.timeout or START_TIMEOUT):
            lines = "\n".join(f"  rank {v.rank}: {_describe(v, now)}" for v in views)
            tails = "".join(self._stderr(r) for r in not_joined)
            raise LaunchError(
                f"rank(s) {', '.join(map(str, not_joined))} did not start and join the process group within "
                f"{now - self.t0:.1f} s:\n{lines}{tails}\n\nThe machine may be overloaded (too many ranks for its "
                f"cores or memory): try a smaller world_size.")
        why = _find_mismatch(views, now)
        if why:
            statuses = {v.rank: _describe(v, now) for v in views}
            lines = "\n".join(f"  rank {r}: {s}" for r, s in statuses.items())
            raise CollectiveMismatchError(
                f"collective mismatch: {why}. This would deadlock.\nStatus of every rank:\n{lines}\n\n"
                "Every rank of a group must call the same collectives in the same order with the same dtype and "
                "size. Look for a collective under `if rank == ...`, or a loop that runs a different number of "
                "times on different ranks.", statuses)
        stuck = [v for v in views if v.waiting and self.hang_timeout is not None and v.waited(now) > self.hang_timeout]
        if stuck:
            v = max(stuck, key=lambda v: v.waited(now))
            raise self._hang_error(views, f"rank {v.rank} waited in {v.waiting[2]} (#{v.waiting[1]} of group "
                                          f"{v.waiting[0]}) for {v.waited(now):.1f} s > hang_timeout="
                                          f"{self.hang_timeout} s")
        if self.timeout is not None and now - self.t0 > self.timeout:
            raise self._timeout_error(views, now)

    def _where(self, views: list[_View], now: float) -> tuple[dict[int, str], dict[int, str], str]:
        """Every rank's status and Python stack, and both as the text that errors show."""
        statuses = {v.rank: _describe(v, now) for v in views}
        stacks = self._stacks()
        lines = "\n".join(f"  rank {r}: {s}" for r, s in statuses.items())
        dumps = "\n".join(f"--- rank {r} ---\n{_indent(s or '(no stack: the process did not answer)')}"
                          for r, s in stacks.items())
        return statuses, stacks, (f"Status of every rank:\n{lines}\n\nPython stack of every rank (faulthandler, "
                                  f"most recent call first):\n{dumps}")

    def _timeout_error(self, views: list[_View], now: float) -> LaunchTimeoutError:
        statuses, stacks, where = self._where(views, now)
        last = max((v.state["t"] for v in views if v.state), default=self.t0)
        return LaunchTimeoutError(
            f"launch({self.fn_name}) stopped at its time limit: it ran {now - self.t0:.1f} s > timeout="
            f"{self.timeout} s, the limit this call passed, so the ranks were stopped. That is a limit, not a "
            f"diagnosis: the last change of any rank's status was {now - last:.1f} s ago (hangs in a collective "
            f"are what hang_timeout catches).\n{where}\n\nPass a larger timeout, or timeout=None (the default) "
            "for no limit.", statuses, stacks)

    def _hang_error(self, views: list[_View], what: str) -> RankHangError:
        statuses, stacks, where = self._where(views, time.time())
        culprits = _holdouts(views)
        if culprits:
            blame = "Likely culprit: " + "; ".join(f"rank {r} ({why})" for r, why in sorted(culprits.items()))
        elif any(v.waiting for v in views):
            blame = "Every rank waits in the same collective: look at the stacks below."
        else:
            blame = "No rank is in a collective: fn is slow or stuck in user code on every rank."
        fix = "If a rank legitimately computes that long between collectives, raise hang_timeout (None: off)."
        return RankHangError(f"ranks hung: {what}.\n{blame}\n\n{where}\n\n{fix}", statuses, stacks,
                             sorted(culprits))

    def _say_where_on_interrupt(self) -> None:
        """Ctrl-C (or SIGTERM) during a launch: before the ranks are stopped, print where each one was, so that
        a run stuck in something no check sees (a lock, a queue, an endless loop) still shows its line."""
        if getattr(self, "slots", None) is None or not self.procs:
            return
        try:
            _, _, where = self._where(self._views({}), time.time())
        except Exception:   # never let the report hide the interrupt itself
            return
        print(f"zeroedu launch({self.fn_name}) interrupted after {time.time() - self.t0:.1f} s; the ranks are "
              f"being stopped.\n{where}", file=sys.stderr, flush=True)

    def _stacks(self) -> dict[int, str]:
        """Ask every live rank for its Python stack (faulthandler prints it on SIGUSR1) and read the files."""
        paths = {r: os.path.join(self.dir, f"rank{r}.stack") for r in range(self.world_size)}
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        for r in alive:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        deadline = time.monotonic() + STACK_WAIT
        while time.monotonic() < deadline and not all(os.path.getsize(paths[r]) if os.path.exists(paths[r])
                                                      else 0 for r in alive):
            time.sleep(0.02)
        time.sleep(0.05)  # let the last dump finish writing
        return {r: _with_source(_trim_stack(_tail(paths[r], 400))) for r in range(self.world_size)}


# -- torchrun and single-process initialization --------------------------------------------------------------

def init_distributed(backend: str = "auto") -> tuple[int, int]:
    """Make sure the default process group exists and return (rank, world_size).

    Already initialized: nothing to do. Under torchrun (RANK and WORLD_SIZE in the environment): join it with
    env://; 'auto' picks NCCL when every local rank has a GPU (and selects GPU LOCAL_RANK). Otherwise: a world of
    one process on gloo, over a store listening on 127.0.0.1 only.
    """
    global _SINGLE_STORE
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise LaunchError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: start the script with "
                              "torchrun, or unset RANK and WORLD_SIZE to use zeroedu.launch(fn, world_size).")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
        backend = _choose_backend(backend, local_ranks)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, init_method="env://")
        return dist.get_rank(), dist.get_world_size()
    backend = "gloo" if backend == "auto" else _choose_backend(backend, 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach())  # the store owns and closes the descriptor
    _SINGLE_STORE = store
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())  # gloo's listener on loopback only
    try:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    return 0, 1


def _launch_in_torchrun(fn: Callable, world_size: int, args: Sequence, kwargs: dict, backend: str) -> list:
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise LaunchError(f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={env_world}: torchrun "
                          f"already started the ranks. Pass world_size={env_world}, or change torchrun's "
                          "--nnodes/--nproc-per-node.")
    created = not dist.is_initialized()
    rank, size = init_distributed(backend)
    result = fn(rank, size, *args, **kwargs)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, result)
    if created:
        dist.destroy_process_group()
    return gathered


def launch(fn: Callable, world_size: int = 4, args: Sequence = (), kwargs: dict | None = None,
           backend: str = "auto", timeout: float | None = None, hang_timeout: float | None = 30.0) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on world_size ranks and return their results by rank.

    Each rank is a process with the default process group initialized (gloo, or NCCL with a GPU per rank) and
    destroyed after fn. fn may be defined in a notebook cell, a script or a script piped on stdin. Collectives
    are watched whether they go through zeroedu's comm layer or torch.distributed directly. Failures raise
    LaunchError subclasses: RankError (a rank raised or died), CollectiveMismatchError (ranks in different
    collectives), RankHangError (a rank waited in a collective longer than hang_timeout seconds); each names
    the ranks, and a hang shows every rank's Python stack. `timeout` (default None: no limit) bounds the whole
    launch in seconds; a launch stopped by it raises LaunchTimeoutError, which says so.
    SIGTERM and SIGHUP stop a launch the way Ctrl-C does, cleaning up first.
    Under torchrun no process is started: fn runs here and the results are gathered from every rank.
    """
    if _CONTEXT is not None:
        raise LaunchError(f"launch() was called inside rank {_CONTEXT.rank}, which launch() started: ranks cannot "
                          "start ranks. fn already runs on every rank; call the code directly, or call launch() "
                          "from the notebook or the script's top level.")
    _check_world_size(world_size)
    kwargs = dict(kwargs or {})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_in_torchrun(fn, world_size, args, kwargs, backend)
    backend = _choose_backend(backend, world_size)
    _check_memory(world_size)
    for name, value in (("timeout", timeout), ("hang_timeout", hang_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, or None for no limit; got {value!r}")
    try:
        payload = _dumps((fn, tuple(args), kwargs))
    except Exception as e:
        raise LaunchError(f"could not send fn and its arguments to the ranks: cloudpickle failed with "
                          f"{type(e).__name__}: {e}. Pass picklable data (numbers, tensors, config dicts, file "
                          "names), not open files, locks, generators or process groups.") from e
    return _Run(fn, world_size, payload, backend, timeout, hang_timeout).run()


# `zeroedu.launch` is this function once zeroedu/__init__.py imports it, so the module's other names are also
# reachable as attributes of it: zeroedu.launch.report_status(...), zeroedu.launch.init_distributed().
for _name in ("report_status", "init_distributed", "in_launched_rank", "LaunchError", "RankError",
              "CollectiveMismatchError", "RankHangError", "LaunchTimeoutError"):
    setattr(launch, _name, globals()[_name])
del _name
