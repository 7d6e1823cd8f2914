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
- The ranks rendezvous through a FileStore in the run's folder, which only this user can open (0700): on a shared
  machine no other local user can join or write to it, as they could to a TCP store on loopback. Gloo's own
  connections are pinned to the loopback interface.
- Each rank writes what it is doing into a small shared-memory slot (`report_status`; the rank's context
  observes every collective of the comm layer through zeroedu.comm.observe). The parent watches the slots and
  turns mismatched collectives and hangs into errors that name the ranks, with every rank's Python stack
  (faulthandler), instead of a notebook cell that never ends.

The parts: the rank process, and how it is started, in zeroedu.launch_rank; the status slots and the per-group
collective counter in zeroedu.launch_status; what the parent makes of them (mismatches, hangs, dead ranks) in
zeroedu.launch_diagnose; the run folder and the stale ones in zeroedu.launch_rundir. Here: launch() and its
errors, the checks before anything starts, the parent that starts, watches and stops the ranks, and torchrun.
"""

from __future__ import annotations

import operator
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from zeroedu._aliases import callable_module
from zeroedu.launch.diagnose import (
    View,
    collect_stacks,
    describe_rank,
    died_message,
    find_mismatch,
    hang_message,
    holdouts,
    mismatch_message,
    not_joined_message,
    raised_message,
    sequence_note,
    stuck_message,
    timeout_message,
    where_text,
)
from zeroedu.launch.rank import (
    KILL_GRACE,
    dumps_by_value,
    loopback_interface,
    main_without_a_file,
    mp_context,
    rank_main,
)
from zeroedu.launch.rundir import (
    RUN_DIR_PREFIX,
    note_forkserver_dir,
    process_identity,
    remove_stale_forkserver_dirs,
    remove_stale_run_dirs,
)
from zeroedu.launch.status import Slots, in_launched_rank, rank_context, report_status
from zeroedu.launch.status import next_collective as next_collective  # zeroedu.comm imports it from here
from zeroedu.sysinfo import available_memory

__all__ = ["CollectiveMismatchError", "LaunchError", "LaunchTimeoutError", "RankError", "RankHangError",
           "in_launched_rank", "init_distributed", "launch", "report_status"]

MEMORY_PER_RANK_GB = 0.5    # rough resident size of one rank process (torch + gloo + a tiny model)
START_TIMEOUT = 60.0        # seconds for every rank to start and join the process group
POLL = 0.1                  # seconds between looks at the status slots
PG_TIMEOUT = 1800.0         # torch's default limit on one collective (30 min), kept unless ours need more

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

# -- checks before anything starts ---------------------------------------------------------------------------

def _check_world_size(world_size: Any) -> int:
    """world_size as an int: any integer type (numpy's too, through __index__), never a bool or a float."""
    try:
        n = operator.index(world_size)
    except TypeError:
        n = None
    if isinstance(world_size, bool) or n is None or n < 1:
        raise ValueError(f"world_size must be an int >= 1 (the number of ranks), got {world_size!r}")
    return n


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


# -- the parent ----------------------------------------------------------------------------------------------

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
        remove_stale_run_dirs()
        remove_stale_forkserver_dirs()
        note_forkserver_dir()
        with _StopSignals():
            return self._run()

    def _run(self) -> list:
        self.dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        slots = None
        try:
            with open(os.path.join(self.dir, "owner"), "w") as f:   # for the next launch, should this one be killed
                f.write(process_identity(os.getpid()))
            # The ranks meet through a FileStore in self.dir (0700: launch_rank.rendezvous_store), not a TCP store
            # that any local user could write to. The port, bound and held here but not listening, is only what
            # MASTER_PORT says in the ranks, for code that reads it.
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            self.slots = slots = Slots(os.path.join(self.dir, "status"), self.world_size, create=True)
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
        ctx = mp_context()
        start_timeout = min(START_TIMEOUT, self.timeout or START_TIMEOUT)
        # torch's own limit on one collective stays above both of ours, so that ours are the ones that speak
        pg_timeout = max([PG_TIMEOUT, *(t + START_TIMEOUT for t in (self.timeout, self.hang_timeout) if t)])
        env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
        self.t0 = time.time()
        with main_without_a_file():
            self._start_ranks(ctx, port, env, path, cwd, pg_timeout, start_timeout)

    def _start_ranks(self, ctx, port, env, path, cwd, pg_timeout, start_timeout) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=rank_main, name=f"zeroedu-rank{rank}", args=(
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

    def _views(self, results: dict) -> list[View]:
        return [View(r, self.slots.read(r), r in results, self.procs[r].exitcode, self.procs[r].pid)
                for r in range(self.world_size)]

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

    # -- failures (the texts: zeroedu.launch_diagnose) --
    def _rank_error(self, rank: int, exc_type: str, exc_msg: str, tb: str) -> RankError:
        msg, tb = raised_message(self.dir, self.world_size, rank, exc_type, exc_msg, tb)
        if exc_type != "CollectiveDriftError":   # that one names the ranks already
            msg += sequence_note(self._views({}), msg)
        return RankError(msg, rank, tb)

    def _died_error(self, rank: int) -> RankError:
        code = self.procs[rank].exitcode
        state = self.slots.read(rank)
        msg = died_message(self.dir, self.world_size, rank, code, self.procs[rank].pid, state)
        msg += sequence_note(self._views({}), msg)
        return RankError(msg, rank, "", code)

    def _check(self, results: dict) -> None:
        now = time.time()
        views = self._views(results)
        not_joined = [v.rank for v in views if v.state is None or v.state["s"] in ("starting", "joining")]
        if not_joined and now - self.t0 > min(START_TIMEOUT, self.timeout or START_TIMEOUT):
            raise LaunchError(not_joined_message(self.dir, views, not_joined, now, self.t0))
        why = find_mismatch(views, now)
        if why:
            statuses = {v.rank: describe_rank(v, now) for v in views}
            raise CollectiveMismatchError(mismatch_message(why, statuses), statuses)
        stuck = [v for v in views if v.waiting and self.hang_timeout is not None and v.waited(now) > self.hang_timeout]
        if stuck:
            v = max(stuck, key=lambda v: v.waited(now))
            raise self._hang_error(views, stuck_message(v, now, self.hang_timeout))
        if self.timeout is not None and now - self.t0 > self.timeout:
            raise self._timeout_error(views, now)

    def _where(self, views: list[View], now: float) -> tuple[dict[int, str], dict[int, str], str]:
        """Every rank's status and Python stack, and both as the text that errors show."""
        statuses = {v.rank: describe_rank(v, now) for v in views}
        stacks = collect_stacks(self.dir, self.procs, self.world_size)
        return statuses, stacks, where_text(statuses, stacks)

    def _timeout_error(self, views: list[View], now: float) -> LaunchTimeoutError:
        statuses, stacks, where = self._where(views, now)
        last = max((v.state["t"] for v in views if v.state), default=self.t0)
        return LaunchTimeoutError(timeout_message(self.fn_name, now, self.t0, self.timeout, last, where),
                                  statuses, stacks)

    def _hang_error(self, views: list[View], what: str) -> RankHangError:
        statuses, stacks, where = self._where(views, time.time())
        culprits = holdouts(views)
        return RankHangError(hang_message(what, views, culprits, where), statuses, stacks, sorted(culprits))

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


# -- torchrun and single-process initialization --------------------------------------------------------------

_SINGLE_STORE: dist.Store | None = None     # keeps init_distributed's store alive


def init_distributed(backend: str = "auto") -> tuple[int, int]:
    """Make sure the default process group exists and return (rank, world_size).

    Already initialized: nothing to do. Under torchrun (RANK and WORLD_SIZE in the environment): join it with
    env://; 'auto' picks NCCL when every local rank has a GPU (and selects GPU LOCAL_RANK). Otherwise: a world of
    one process on gloo, over an in-process store (nothing listens).
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
    # A world of one meets nobody: an in-process store, so nothing listens that another local user could open.
    store = dist.HashStore()
    _SINGLE_STORE = store
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # gloo's listener on loopback only
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
    ctx = rank_context()
    if ctx is not None:
        raise LaunchError(f"launch() was called inside rank {ctx.rank}, which launch() started: ranks cannot "
                          "start ranks. fn already runs on every rank; call the code directly, or call launch() "
                          "from the notebook or the script's top level.")
    world_size = _check_world_size(world_size)
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"launch(fn, world_size, args=...) takes fn's arguments after rank and world_size as a tuple "
                        f"or list; got {type(args).__name__} {args!r:.60}. For one argument write args=(value,).")
    kwargs = dict(kwargs or {})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _launch_in_torchrun(fn, world_size, args, kwargs, backend)
    backend = _choose_backend(backend, world_size)
    _check_memory(world_size)
    for name, value in (("timeout", timeout), ("hang_timeout", hang_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, or None for no limit; got {value!r}")
    try:
        payload = dumps_by_value((fn, tuple(args), kwargs))
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

# zeroedu.launch is this package; calling it calls launch() (`zeroedu.launch(train, world_size=4)`), whatever
# submodule was imported first. zeroedu._aliases says why.
callable_module(__name__, launch)
