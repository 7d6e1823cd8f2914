"""The comm thread: one per process, running asynchronous collectives in submission order.

One thread keeps every rank's order of collectives identical, which is what makes them match up, and gives
overlap (the main thread keeps computing backward while a bucket reduces). Handing a job to another thread costs
about a millisecond on a busy CPU, so `run` lets the caller run a job itself when nothing is queued.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class Handle:
    """A collective (or a closure of them) running on the comm thread; or a native collective that
    torch.distributed runs on its own threads (`work`), finished by `finish` at the first wait."""

    def __init__(self, work=None, finish: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._work, self._finish = work, finish
        self._lock = threading.Lock()

    def wait(self) -> None:
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


class _Worker:
    """The one thread per process that runs collectives, in order."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.pending = 0                    # jobs submitted and not finished
        self.count = threading.Lock()       # guards pending
        self.running = threading.Lock()     # held while a job runs, here or inline in a caller
        # The CUDA device is per thread: the comm thread works on the device of the thread that started it.
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.thread = threading.Thread(target=self._run, name="zeroedu-comm", daemon=True)
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
        if threading.current_thread() is self.thread:  # already on the comm thread: run inline
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
        same order as submitting and waiting, without waking the comm thread (a thread hand-off costs about a
        millisecond on a busy CPU, more than a small collective)."""
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


_WORKER: _Worker | None = None


def worker() -> _Worker:
    """This process's comm thread, started at first use (again if it died)."""
    global _WORKER
    if _WORKER is None or not _WORKER.thread.is_alive():
        _WORKER = _Worker()
    return _WORKER
