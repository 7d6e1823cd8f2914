"""The rank side of launch(): what runs in each rank process, from the forkserver's fork to os._exit.

`rank_main` is the target launch() gives multiprocessing (by reference: this module must stay importable as
zeroedu.launch_rank). It makes the process a rank (dies with the parent, stop signals run the exit handlers,
stdout and stderr into the run's folder, the parent's environment), joins the process group over the parent's
store, runs fn, and sends the result or the error back over its pipe. fn and its result travel by value
(cloudpickle, `dumps_by_value`), so a function defined in a notebook cell or in `__main__` works. How a rank process
is started (forkserver, `mp_context`) is here too; the parent that starts it is zeroedu.launch.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections import ChainMap
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import cloudpickle
import torch
import torch.distributed as dist

from zeroedu.comm.agreement import finish_all
from zeroedu.compat import finalizers_run_at_exit
from zeroedu.launch.status import RankContext, Slots, start_reporting, watch_torch_distributed

KILL_GRACE = 3.0            # seconds between SIGTERM and SIGKILL when stopping ranks (their exit handlers run)
# forkserver where the platform has it (Linux, macOS); ZEROEDU_START_METHOD=spawn to compare.
START_METHOD = os.environ.get("ZEROEDU_START_METHOD") or (
    "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
# What the forkserver imports once, so that no rank pays for it: torch, and torch._dynamo, which the first
# optimizer a rank builds imports (800-odd modules, seconds a rank: docs/benchmarks.md).
FORKSERVER_PRELOAD = ["torch", "torch._dynamo"]


# -- starting a rank process ---------------------------------------------------------------------------------

def mp_context() -> mp.context.BaseContext:
    """The multiprocessing context that starts the ranks (START_METHOD)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # only takes effect when the forkserver starts
    return ctx


class main_without_a_file:
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


def dumps_by_value(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


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


def rank_main(rank: int, world_size: int, port: int, backend: str, conn: Connection, run_dir: str,
               payload: bytes, env: dict[str, str], sys_path: list[str], cwd: str, pg_timeout: float | None,
               start_timeout: float) -> None:
    ctx, release = _become_rank(rank, world_size, port, conn, run_dir, env, sys_path, cwd)
    try:   # inline, so fn's frame sits right below this one: a crash's stack stays short enough for the stderr tail
        fn, args, kwargs = cloudpickle.loads(payload)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # 4 ranks on 2 cores: 1 thread each
        if backend == "nccl":
            torch.cuda.set_device(rank)
        ctx.set("joining")
        store = rendezvous_store(run_dir, world_size, start_timeout)
        kw = {"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kw)
        ctx.set("running")
        result = fn(rank, world_size, *args, **kwargs)
        ctx.set("returned")   # fn is done: what follows waits only for the other ranks' last agreement checks
        finish_all("the end of launch()'s fn")   # a drift in the last steps is raised here (zeroedu.comm.agreement)
        try:
            data = dumps_by_value(result)
        except Exception as e:
            raise TypeError(f"the return value of fn ({type(result).__name__}) cannot be pickled to send it back "
                            f"to the parent: {e}. Return plain data: numbers, lists, dicts, CPU tensors.") from e
    except BaseException as e:
        _send_error_and_exit(conn, e)
    ctx.set("returned")
    conn.send(("ok", time.time(), data))
    release.wait()  # stay until every rank returned: no rank leaves a collective its peers are still finishing
    dist.destroy_process_group()
    _run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rendezvous_store(run_dir: str, world_size: int, timeout: float) -> dist.FileStore:
    """The ranks meet through a file in the run's folder, which tempfile.mkdtemp made 0700: only this user can
    open it. A TCP store on loopback, however bound, accepts any local user's connection and keys (another
    learner on a shared JupyterHub could write into a running launch's rendezvous)."""
    store = dist.FileStore(os.path.join(run_dir, "rendezvous"), world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _become_rank(rank: int, world_size: int, port: int, conn: Connection, run_dir: str, env: dict[str, str],
                 sys_path: list[str], cwd: str) -> tuple[RankContext, threading.Event]:
    """Make this freshly forked process rank `rank`: its status says "starting". Returns its status context and
    the event that the parent's "release" sets (every rank returned)."""
    _die_with_parent()
    finalizers_run_at_exit()   # Python 3.13's forkserver cleared them (zeroedu.compat says why)
    _exit_cleanly_on_stop_signals()
    _capture_output(run_dir, rank)
    _adopt_parent_environment(rank, world_size, port, env, sys_path, cwd)
    release = threading.Event()
    threading.Thread(target=_watch_parent, args=(conn, release), name="zeroedu-parent-watch", daemon=True).start()
    ctx = start_reporting(rank, Slots(os.path.join(run_dir, "status"), world_size, create=False))
    ctx.set("starting")
    watch_torch_distributed()   # before fn arrives: fn may hold torch.distributed's functions themselves
    return ctx, release


_STACK_FILE = None   # a rank's faulthandler file for SIGUSR1 stack dumps: open until the rank exits


def _capture_output(run_dir: str, rank: int) -> None:
    """The rank's stdout and stderr into files of the run's folder, at the file-descriptor level so that gloo's
    C++ messages land there too; a Python stack on a segfault, and on SIGUSR1 into rank<N>.stack."""
    global _STACK_FILE
    for fd, name in ((1, "stdout"), (2, "stderr")):
        # 0o644: a log, not a program (os.open's default mode, 0o777, made them executable under umask 022)
        log = os.open(os.path.join(run_dir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())  # gloo listens on loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    sys.path[:] = sys_path
    try:
        os.chdir(cwd)
    except OSError:
        pass


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), for gloo and NCCL to listen on."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n.startswith("lo")), "lo")


def _send_error_and_exit(conn: Connection, e: BaseException) -> NoReturn:
    """Tell the parent what fn (or joining the group) raised, with a traceback that starts in fn, and exit."""
    tb = e.__traceback__
    if tb is not None and tb.tb_frame.f_code is rank_main.__code__ and tb.tb_next is not None:
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
