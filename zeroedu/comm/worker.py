"""The one asynchronous mechanism: a worker with lanes, and one Handle type for everything that runs on it.

A lane is one thread that runs its jobs in submission order:
- "comm": collectives (and the work that belongs with them). One thread keeps every rank's order of collectives
  identical, which is what makes them match up, and gives overlap (the main thread keeps computing backward while
  a bucket reduces). Handing a job to another thread costs about a millisecond on a busy CPU, so `run` lets the
  caller run a job itself when nothing is queued: the same order, without the hand-off.
- "io": offload's NVMe reads and writes, so that they overlap the optimizer step and the collectives.

Every job returns a Handle; so does a native torch.distributed collective started asynchronously (its `work`,
finished at the first wait). The engine keeps every handle it started in one set, `Engine.in_flight`, that
`Engine.wait()` drains. On a GPU, CUDA events (offload's side-stream copies) are the only other mechanism:
a copy there is asynchronous because of its stream, not a thread, so it cannot be a lane's job; the reasons,
and what folding it in would take, are in zeroedu/engine/extras/offload/transfers.py. The agreement check
(zeroedu.comm.agreement) keeps its own few torch Works and settles them each step; tests/test_worker.py
lists every place that may start something asynchronous.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

LANES = ("comm", "io")


class Handle:
    """A job on a lane (a collective, a closure of them, a file read or write); or a native collective that
    torch.distributed runs on its own threads (`work`), finished by `finish` at the first wait."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._work, self._finish = work, finish
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Finished (a native collective: finished and waited for)."""
        return self._done.is_set()

    def settled(self) -> bool:
        """Finished without an error: nothing is left to wait for or to report."""
        return self._done.is_set() and self._error is None

    def wait(self) -> None:
        """Return once the job is done; raise what it raised."""
        if self._work is not None:
            with self._lock:
                if not self._done.is_set():
                    try:
                        self._work.wait()
                        self._finish()
                    except BaseException as e:
                        self._error = e
                    self._done.set()
        self._done.wait()
        if self._error is not None:
            raise self._error


class Lane:
    """One thread that runs jobs in order."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.pending = 0                    # jobs submitted and not finished
        self.count = threading.Lock()       # guards pending
        self.running = threading.Lock()     # held while a job runs, here or inline in a caller
        # The CUDA device is per thread: the lane works on the device of the thread that started it.
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.thread = threading.Thread(target=self._run, name=f"zeroedu-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        while True:
            fn, handle = self.jobs.get()
            with self.running:
                try:
                    fn()
                except BaseException as e:  # handed to whoever waits
                    handle._error = e
            del fn   # before the waiter wakes: the job's closure would keep the buffers it names alive
            with self.count:
                self.pending -= 1
            handle._done.set()

    def submit(self, fn: Callable[[], None]) -> Handle:
        h = Handle()
        if threading.current_thread() is self.thread:  # already on this lane: run inline
            try:
                fn()
            except BaseException as e:
                h._error = e
            h._done.set()
            return h
        with self.count:
            self.pending += 1
        self.jobs.put((fn, h))
        return h

    def idle(self) -> bool:
        with self.count:
            return self.pending == 0

    def run(self, fn: Callable[[], None]) -> None:
        """Run fn and return when it is done. With nothing queued or running, the caller runs it itself: the
        same order as submitting and waiting, without waking the lane's thread."""
        if threading.current_thread() is not self.thread:
            with self.count:
                idle = self.pending == 0
                self.pending += idle
            if idle:
                try:
                    with self.running:
                        fn()
                finally:
                    with self.count:
                        self.pending -= 1
                return
        self.submit(fn).wait()


class Worker:
    """The process's lanes, each started at first use (again if its thread died)."""

    def __init__(self) -> None:
        self.lanes: dict[str, Lane] = {}
        self._guard = threading.Lock()

    def lane(self, name: str = "comm") -> Lane:
        if name not in LANES:
            raise ValueError(f"no lane {name!r}: the worker's lanes are {', '.join(LANES)}")
        lane = self.lanes.get(name)
        if lane is not None and lane.thread.is_alive():   # the common case, without the lock
            return lane
        with self._guard:
            lane = self.lanes.get(name)
            if lane is None or not lane.thread.is_alive():
                lane = self.lanes[name] = Lane(name)
            return lane

    # The comm lane's interface, as the comm thread had it (zeroedu.comm calls these).
    def submit(self, fn: Callable[[], None], lane: str = "comm") -> Handle:
        return self.lane(lane).submit(fn)

    def run(self, fn: Callable[[], None], lane: str = "comm") -> None:
        self.lane(lane).run(fn)

    def idle(self, lane: str = "comm") -> bool:
        return self.lane(lane).idle()

    @property
    def thread(self) -> threading.Thread:
        return self.lane("comm").thread


_WORKER = Worker()


def worker() -> Worker:
    """This process's worker."""
    return _WORKER
