"""How a test cell, run in the grader's process, talks to the learner's kernel while it runs.

_KernelLink: what in_kernel and the learner proxies (remote.py) call; kernel.serve runs in the kernel for the
whole cell, and requests and answers go through two named pipes in the work folder (kernel_exchange).
_Captured: sys.stdout and sys.stderr sending each test's prints to its own buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any

from zeroedu.grading import remote
from zeroedu.i18n import tr


class _Captured:
    """sys.stdout and sys.stderr that send a thread's writes to its buffer while it runs a test (notebooks may
    be graded in parallel threads), and everything else where it went before."""

    local = threading.local()
    _lock = threading.Lock()

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        buffer = getattr(self.local, "buffer", None)
        return (buffer or self.stream).write(text)

    def flush(self) -> None:
        buffer = getattr(self.local, "buffer", None)
        (buffer or self.stream).flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not isinstance(sys.stdout, cls):
                sys.stdout = cls(sys.stdout)
            if not isinstance(sys.stderr, cls):
                sys.stderr = cls(sys.stderr)


class _KernelLink:
    """What in_kernel and the learner proxies talk to while the grader runs one test cell (from a worker
    thread): kernel.serve runs in the kernel for the whole cell, and requests and answers go through two named
    pipes in the work folder, under what is left of the test's time."""

    def __init__(self, runner: Any, deadline: float) -> None:   # runner.py's _Runner, running the cell
        self.runner = runner
        self.deadline = deadline
        self.status = "ok"
        self.detail = ""
        self.folder = runner.exchange   # the grader's own folder: nothing in it is the learner's to name
        self.future: Any = None
        self.requests = -1
        self.answers = -1
        self.paths: list[Path] = []
        self.wire: int | None = None   # TCP payload the sandbox sent during the last call (wire.Meter), if counted

    def _start(self) -> None:
        token = os.urandom(8).hex()
        paths = [self.folder / f"{token}.{end}" for end in ("in", "out")]
        uid = getattr(self.runner.sandbox, "uid", -1)
        for path in paths:   # in a folder only the grader writes: no link or race can redirect these calls
            os.mkfifo(path, 0o600)
            if uid >= 0:
                os.chown(path, uid, uid, follow_symlinks=False)   # the kernel runs as the sandbox's own user
        assert self.runner.loop is not None
        self.future = asyncio.run_coroutine_threadsafe(self.runner.serve(token, self.deadline), self.runner.loop)
        self.paths = paths
        self.answers = os.open(paths[1], os.O_RDONLY | os.O_NONBLOCK)
        while True:   # the write end opens once the kernel has opened the read end
            try:
                self.requests = os.open(paths[0], os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if self.future.done() or time.monotonic() > self.deadline:
                    self._ended()
                time.sleep(0.005)

    def _ended(self) -> None:
        status, detail = self.future.result() if self.future is not None and self.future.done() else \
            ("timeout", f"{max(0.0, self.deadline - time.monotonic()):.0f}")
        self.status, self.detail = (status, detail) if status != "ok" else ("ended", "")
        if status in ("killed", "died"):
            self.runner.kernel_lost = True
        raise remote.KernelUnavailable(tr(f"your code did not finish: {status}", f"你的代码没有运行完：{status}")
                                       if status != "ok" else
                                       tr("the kernel stopped answering (your code ended the grader's request loop)",
                                          "kernel 不再应答（你的代码结束了评分器的请求循环）"))

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self.answers], [], [], max(0.0, min(left, 0.5)))
            if ready:
                chunk = os.read(self.answers, min(n - len(out), 1 << 20))
                if not chunk:
                    self._wait_end()
                out += chunk
            elif left <= 0 or (self.future is not None and self.future.done()):
                self._wait_end()
        return bytes(out)

    def _write(self, data: bytes) -> bool:
        """Write to the request pipe before the deadline; False if the kernel stopped reading (its code may have
        filled the pipe itself and kept it open: a blocking write would wait forever)."""
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0 or (self.future is not None and self.future.done()):
                return False
            _, ready, _ = select.select([], [self.requests], [], min(left, 0.5))
            if not ready:
                continue
            try:
                view = view[os.write(self.requests, view[:65536]):]
            except BlockingIOError:
                continue
            except OSError:
                return False
        return True

    def _wait_end(self) -> None:
        if self.future is not None:
            with contextlib.suppress(Exception):
                self.future.result(timeout=max(1.0, self.deadline - time.monotonic() + 10))
        self._ended()

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self.status != "ok" or self.runner.kernel_lost:
            raise remote.KernelUnavailable("the kernel is gone (an earlier request of this test timed out or "
                                           "ended it)")
        if self.future is None:
            self._start()
        data = pickle.dumps({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs)})
        meter = getattr(self.runner, "meter", None)
        self.wire, before = None, meter.read() if meter is not None else None
        if not self._write(len(data).to_bytes(8, "big") + data):
            self._wait_end()
        size = int.from_bytes(self._read(8), "big")
        after = meter.read() if meter is not None else None   # the answer is in: the ranks are gone
        if before is not None and after is not None:
            self.wire = after - before
        if size > remote.MAX_ANSWER_BYTES:
            cap = remote.MAX_ANSWER_BYTES
            raise remote.KernelUnavailable(tr(f"your code returned {size} bytes of data, more than the grader reads "
                                              f"({cap})",
                                              f"你的代码返回了 {size} 字节的数据，超过了评分器读取的上限（{cap}）"))
        return remote.decode_answer(self._read(size), self.runner.limits.max_output, self.runner.ns)

    def close(self) -> None:
        """Tell the kernel's loop this test is done, and wait for its cell to end."""
        if self.future is None:
            return
        with contextlib.suppress(OSError):   # never blocks: a full pipe means the kernel's loop is not reading
            os.write(self.requests, (0).to_bytes(8, "big"))
        for fd in (self.requests, self.answers):
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in self.paths:
            path.unlink(missing_ok=True)
        try:
            status, detail = self.future.result(timeout=max(5.0, self.deadline - time.monotonic() + 10))
        except Exception:
            status, detail = "timeout", ""
        if status != "ok" and self.status == "ok":
            self.status, self.detail = status, detail
        if status in ("killed", "died"):
            self.runner.kernel_lost = True


def kernel_exchange() -> str:
    from zeroedu.grading.kernel import EXCHANGE

    return EXCHANGE
