"""The grader's end of a graded notebook's kernel as nbclient sees it, and the caps on what comes out of it.

OUTPUT_CAP: code run in the kernel first, capping what print() and an exception can send; _Client: nbclient
keeping at most --max-output bytes of output; _LogPipe: the pipe that carries the kernel's stdout and stderr
(and the guard's refusals) into a file; _cut: text cut to a limit, saying how much was cut.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

# Runs in the kernel before anything else: caps what print() can push through ZeroMQ at the source, so a
# runaway loop of prints costs the grader little even before its own cap (in _Client.output) drops the rest.
OUTPUT_CAP = """
import sys as _sys

def _zeroedu_cap(stream, budget):
    write, left = stream.write, [budget]
    def capped(text):
        if left[0] <= 0:
            return len(text)
        left[0] -= len(text)
        return write(text if left[0] >= 0 else text[:left[0] + len(text)])
    stream.write = capped

_zeroedu_cap(_sys.stdout, {budget})
_zeroedu_cap(_sys.stderr, {budget})


def _zeroedu_short_errors(budget):
    # An exception's message and traceback are cut here, before they are sent: a 100 MB message raised at the
    # top level of a cell would otherwise cross ZeroMQ whole, twice (the error output and the execute reply).
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return

    def short(self, etype, value, tb, tb_offset=None):
        try:
            text = str(value)
        except BaseException:
            text = "(its message could not be printed)"
        if len(text) > budget:
            cut = text[:budget] + f" [... {{len(text) - budget}} more characters cut by the grader]"
            try:
                value.args = (cut,)
                ok = len(str(value)) <= budget + 100
            except BaseException:
                ok = False
            if not ok:
                value = type(etype.__name__, (Exception,), {{}})(cut)
                etype = type(value)
            result = getattr(self.displayhook, "exec_result", None)
            if result is not None:
                result.error_in_exec = value
        try:
            stb = self.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
        except BaseException:
            stb = [f"{{etype.__name__}}: {{str(value)[:budget]}}"]
        kept, left = [], budget
        for line in stb[-200:]:
            kept.append(line[:max(0, left)])
            left -= len(kept[-1])
        self._showtraceback(etype, value, kept)
        return kept

    shell.set_custom_exc((BaseException,), short)


_zeroedu_short_errors({budget})
del _zeroedu_cap, _zeroedu_short_errors, _sys
"""


_QUIET = logging.getLogger("zeroedu.grading.nbclient")  # nbclient logs timeouts as errors; we report them ourselves
_QUIET.setLevel(logging.CRITICAL)


class _Client(NotebookClient):
    """nbclient with a cap on the output it keeps: a learner printing gigabytes costs us nothing."""

    def __init__(self, nb: Any, max_output: int, **kw: Any) -> None:
        super().__init__(nb, **kw)
        self.max_output = max_output
        self.output_bytes = 0
        self.truncated = False

    def output(self, outs: list, msg: dict, display_id: str | None, cell_index: int) -> Any:
        content = msg.get("content", {})
        size = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
        room = self.max_output - self.output_bytes
        self.output_bytes += size
        if msg.get("msg_type") == "error":  # errors are how tests fail: always keep them, cut to max_output
            cut = {**content, "ename": str(content.get("ename", ""))[:200],
                   "evalue": _cut(str(content.get("evalue", "")), self.max_output), "traceback": []}
            left = self.max_output
            for line in content.get("traceback", [])[-200:]:
                cut["traceback"].append(str(line)[:max(0, left)])
                left -= len(cut["traceback"][-1])
            return super().output(outs, {**msg, "content": cut}, display_id, cell_index)
        if size <= room:
            return super().output(outs, msg, display_id, cell_index)
        if self.truncated:
            return None
        self.truncated = True
        if msg.get("msg_type") == "stream" and room > 0:  # keep the start of the text that crosses the limit
            msg = {**msg, "content": {**content, "text": content["text"][:room]}}
            super().output(outs, msg, display_id, cell_index)
        outs.append(nbformat.v4.new_output("stream", name="stderr", text=(
            f"\n[zeroedu grade: output cut here; the notebook printed more than {self.max_output} bytes]\n")))
        return None


class _LogPipe:
    """A pipe for the kernel's stdout and stderr, copied into a file by a thread of the grader: the guard's
    refusals written there stay, whatever the learner's code does to its own file descriptors. The file keeps the
    first LOG_BYTES and memory the last TAIL_BYTES (for "the kernel's last message"); the rest of a flood of fd 2
    is read and dropped, so it costs the grader neither memory nor disk."""

    LOG_BYTES = 4 * 2**20
    TAIL_BYTES = 64 * 2**10

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received = 0          # bytes the kernel wrote in all
        self.tail = b""            # the last TAIL_BYTES of them
        self.lock = threading.Lock()
        read, self.fd = os.pipe()
        self.thread = threading.Thread(target=self._drain, args=(read,), daemon=True, name="zeroedu-kernel-log")
        self.thread.start()

    def _drain(self, read: int) -> None:
        with open(self.path, "ab") as out, open(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                room = self.LOG_BYTES - out.tell()
                if room > 0:
                    out.write(chunk[:room])
                    out.flush()
                with self.lock:
                    self.received += len(chunk)
                    self.tail = (self.tail + chunk)[-self.TAIL_BYTES:]

    def since(self, offset: int) -> bytes:
        """What the kernel wrote after `offset` bytes, at most the last TAIL_BYTES of it."""
        with self.lock:
            return self.tail[-max(0, min(self.received - offset, len(self.tail))):] if self.received > offset \
                else b""

    def started(self) -> None:
        """The kernel has its copy: close ours, so the pipe ends when the kernel and its children do."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.started()
        self.thread.join(timeout=2.0)


def _cut(text: str, limit: int) -> str:
    """text, at most `limit` characters: the start, and how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 60)
    return text[:keep] + f" [... {len(text) - keep} more characters cut by --max-output]"
