"""Running one assembled notebook: a fresh kernel (in the sandbox, or --trusted without), one cell at a time.

_Runner runs the learner's cells in the kernel and the test cells here, on proxies of the learner's objects
(link.py); it enforces the time limits, interrupts or kills a kernel that overruns, and replays the cells that
had run in a fresh kernel after a kill or a crash. Each cell's outcome is a CellRun (results.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import nbformat
from nbclient.exceptions import DeadKernelError

from zeroedu.grading import notebook as nbtools
from zeroedu.grading import remote, wire
from zeroedu.grading.client import _QUIET, OUTPUT_CAP, _Client, _cut, _LogPipe
from zeroedu.grading.kernel import EXCHANGE_PATH
from zeroedu.grading.link import _Captured, _KernelLink
from zeroedu.grading.results import CellRun, Limits
from zeroedu.grading.source import grader_names, places
from zeroedu.i18n import ENV as LANG_ENV
from zeroedu.i18n import current, tr

GUARD_DIR = Path(__file__).resolve().parent / "guard"
PROBE_SECONDS = 10.0      # after a timeout, how long an interrupted kernel gets to answer again (loaded machines)
MAX_RESTARTS = 3          # fresh kernels per notebook after kills or crashes
TIMEOUT_ENAME = "GraderTimeout"
REFUSED_ENAME = "RefusedByGrader"   # a cell the grader would not run (forged_answers)
STARTUP_SECONDS = 180     # kernel start plus the set-up code: importing torch on a loaded machine is slow
DEFAULT_SETUP = "import zeroedu.grading"
# What of the grader's environment reaches the kernel: the locale, where programs are, and the CPU kernels'
# settings (the ISA sets of the Makefile, thread counts); nothing else.
KEPT_ENV = {"PATH", "LANG", "LANGUAGE", "TZ", "VIRTUAL_ENV", "CONDA_PREFIX", "CUDA_VISIBLE_DEVICES",
            "GLOO_SOCKET_IFNAME", "ZEROEDU_START_METHOD"}
KEPT_PREFIXES = ("LC_", "OMP_", "MKL_", "ATEN_", "ONEDNN_", "DNNL_", "KMP_", "OPENBLAS_")


class _Runner:
    """Runs one assembled notebook: one kernel (or a fresh one after a kill), one cell at a time."""

    def __init__(self, nb: Any, workdir: Path, private: Path, limits: Limits, sandbox: Any = None) -> None:
        self.nb = nb
        self.workdir = workdir
        self.private = private
        self.limits = limits
        self.sandbox = sandbox
        self.places = places(nb)
        self.ns = remote.Namespace(grader_names(nb))   # names the grader's own cells define are never the learner's
        self.client: _Client | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kernel_lost = False
        self.grader_error = ""
        self.runs: list[CellRun] = [CellRun("not run") for _ in nb.cells]
        self.notes: list[str] = []
        self.truncated = False
        self.t0 = time.monotonic()
        self.pgid: int | None = None
        self.log: _LogPipe | None = None
        self.log_offset = 0
        self.exchange = private / "exchange"   # the test pipes (link.py): made here, by the grader only
        self.exchange.mkdir(mode=0o700, exist_ok=True)
        if sandbox is not None:
            sandbox.exchange = self.exchange

    def env(self) -> dict[str, str]:
        """The kernel's environment: a few settings passed on by name (KEPT_ENV), never the grader's whole
        environment (tokens, paths, anything an instructor exported)."""
        env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith(KEPT_PREFIXES)}
        tmp = self.workdir / ".tmp"
        tmp.mkdir(exist_ok=True)
        env.update(
            ZEROEDU_GRADE_ROOT=str(self.workdir), ZEROEDU_GRADE_CONFIG=str(self.private / "config.json"),
            PYTHONPATH=os.pathsep.join([str(GUARD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
            TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg",
            ZEROEDU_GRADE_EXCHANGE=EXCHANGE_PATH if self.sandbox is not None else str(self.exchange),
            # No module from the work folder shadows zeroedu or torch (python -m puts the current folder first
            # on sys.path), and no usercustomize or .pth from a home the learner wrote runs before the guard.
            PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1",
            # launch() inside a test gives up a little before the cell would be killed: a clearer message.
            ZEROEDU_TEST_TIMEOUT=f"{self.test_timeout():g}",
        )
        # The language the grader grades this notebook in (its declared one, else the grader's): what the harness
        # runs in the kernel (a launch's failure, a rank's error) speaks it too, as the checks here do.
        env[LANG_ENV] = current()
        env.setdefault("PATH", os.defpath)
        if self.sandbox is None and "HOME" in os.environ:   # --trusted: the learner's own machine and home
            env["HOME"] = os.environ["HOME"]
        return env

    def test_timeout(self) -> float:
        """Seconds a launch() inside a test may take: a few seconds under the cell's limit, so that launch can
        stop its ranks and say which line each waits on before the grader interrupts the cell."""
        t = self.limits.cell_timeout
        return max(1.0, min(0.75 * t, t - 3.0))

    def left(self) -> float:
        return self.limits.notebook_timeout - (time.monotonic() - self.t0)

    def run(self) -> None:
        start = 0
        for attempt in range(MAX_RESTARTS + 1):
            start = asyncio.run(self._session(start, replay=attempt > 0))
            if start >= len(self.nb.cells):
                return
            if self.left() <= 0:
                break
        for i in range(start, len(self.nb.cells)):
            if self.runs[i].status == "not run" and self.nb.cells[i].cell_type == "code":
                self.runs[i] = CellRun("not run", evalue=tr("the kernel was restarted too often",
                                                            "kernel 重启次数太多"))

    async def _session(self, start: int, replay: bool) -> int:
        """Run cells from `start` in a fresh kernel; return where to resume if the kernel had to go."""
        client = _Client(self.nb, self.limits.max_output, log=_QUIET, kernel_name="python3", allow_errors=True,
                         interrupt_on_timeout=True, record_timing=False, iopub_timeout=2,
                         resources={"metadata": {"path": str(self.workdir)}}, startup_timeout=STARTUP_SECONDS)
        replies: dict[int, dict] = {}

        def on_executed(cell: Any, cell_index: int, execute_reply: dict | None) -> None:
            if execute_reply is not None:
                replies[cell_index] = execute_reply.get("content", {})

        client.on_cell_executed = on_executed
        self.client, self.loop, self.kernel_lost = client, asyncio.get_running_loop(), False
        log = self.log = _LogPipe(self.private / "kernel.log")  # the kernel's stdout and stderr: a pipe
        self.pgid = None
        self.meter: wire.Meter | None = None
        env = self.env()
        if self.sandbox is not None:
            env = self.sandbox.env(env)
            self.sandbox.prepare()
            client.km = self.sandbox.kernel_manager(client)
        started = False
        try:
            async with client.async_setup_kernel(env=env, stdout=log.fd, stderr=log.fd):
                started = True
                log.started()
                self.pgid = getattr(client.km.provisioner, "pgid", None)
                process = getattr(client.km.provisioner, "process", None)
                self.meter = wire.Meter(process.pid if self.sandbox is not None and process is not None else None)
                problem = await self._setup(client)
                if problem:
                    self.notes.append(problem)
                    for j in range(start, len(self.nb.cells)):
                        self.runs[j] = CellRun("not run", evalue=problem)
                    return len(self.nb.cells)
                if not replay:
                    self.t0 = time.monotonic()  # the notebook's clock starts with its first cell, not the kernel
                if replay:
                    for i in range(start):
                        if self.runs[i].status == "ok" and self.places[i] in ("kernel", "both"):
                            status = await self._kernel_cell(client, replies, i, record=False)
                            if status in ("killed", "died"):
                                return start  # try again in another fresh kernel (MAX_RESTARTS bounds it)
                for i in range(start, len(self.nb.cells)):
                    if self.left() <= 0:
                        limit = f"{self.limits.notebook_timeout:g}"
                        self.notes.append(tr(f"the notebook ran past its {limit} s limit: cells from {i} on did not "
                                             "run", f"notebook 运行超过了 {limit} 秒的上限：第 {i} 个单元格及之后的"
                                             "都没有运行"))
                        for j in range(i, len(self.nb.cells)):
                            self.runs[j] = CellRun("not run", evalue=tr(f"the notebook ran past its {limit} s limit",
                                                                        f"notebook 运行超过了 {limit} 秒的上限"))
                        return len(self.nb.cells)
                    status = await self._execute(client, replies, i)
                    if status in ("killed", "died"):
                        return i + 1
            return len(self.nb.cells)
        except DeadKernelError:
            return start + 1
        except Exception as e:   # the kernel did not start (its start-up died) or stopped talking while set up
            if started:
                raise
            why = f"{type(e).__name__}: {_cut(str(e), 200)}; {self._kernel_tail()}"
            problem = tr(f"the kernel did not start ({why})", f"kernel 没有启动（{why}）")
            self.notes.append(problem)
            for j in range(start, len(self.nb.cells)):
                if self.runs[j].status == "not run":
                    self.runs[j] = CellRun("not run", evalue=problem)
            return len(self.nb.cells)
        finally:
            self.truncated |= client.truncated
            self._kill()  # whatever the kernel started in its process group goes too
            log.close()

    def _kill(self) -> None:
        if self.pgid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            self.pgid = None

    def _role(self, i: int) -> str:
        cell = self.nb.cells[i]
        return nbtools.cell_info(cell).role if cell.metadata.get("zeroedu_grade", {}).get("grade_id") else (
            "markdown" if cell.cell_type != "code" else "free")

    async def _execute(self, client: _Client, replies: dict, i: int, record: bool = True) -> str:
        cell = self.nb.cells[i]
        if cell.cell_type != "code" or not cell.source.strip():
            return "ok"
        if nbtools.SKIP_TAG in cell.metadata.get("tags", []):
            self.runs[i] = CellRun("skipped")
            return "ok"
        refused = cell.metadata.get("zeroedu_grade", {}).get("refused")
        if refused:
            self.runs[i] = CellRun("error", REFUSED_ENAME, refused)
            cell.outputs = [nbformat.v4.new_output("error", ename=REFUSED_ENAME, evalue=refused, traceback=[])]
            return "error"
        if self.places[i] == "grader":
            return await self._grader_cell(i)
        status = await self._kernel_cell(client, replies, i, record)
        if self.places[i] == "both" and status == "ok":
            here = await self._grader_cell(i, record=False)
            if here != "ok":
                self.notes.append(tr(f"the given cell {self._label(i)} failed in the grader: {self.grader_error}",
                                     f"给定的单元格 {self._label(i)} 在评分器中出错：{self.grader_error}"))
        return status

    async def _grader_cell(self, i: int, record: bool = True) -> str:
        """Run a test (or a given cell that uses the learner's names) in this process, on proxies of the
        learner's objects; only plain data comes back from the kernel."""
        cell = self.nb.cells[i]
        gid = cell.metadata.get("zeroedu_grade", {}).get("grade_id") or f"cell {i}"
        code = compile(cell.source, f"<zeroedu grader: {gid}>", "exec")
        out = io.StringIO()
        deadline = time.monotonic() + max(1.0, min(self.limits.cell_timeout, self.left()))
        link = _KernelLink(self, deadline)
        t0 = time.monotonic()

        def work() -> CellRun:
            remote.set_session(link)
            _Captured.install()
            _Captured.local.buffer = out
            try:
                exec(code, self.ns)
                return CellRun("ok", seconds=time.monotonic() - t0)
            except Exception as e:
                return CellRun("error", type(e).__name__, _cut(str(e), self.limits.max_output),
                               time.monotonic() - t0)
            finally:
                link.close()
                remote.set_session(None)
                _Captured.local.buffer = None

        run = await asyncio.to_thread(work)
        if link.status in ("timeout", "killed", "died"):
            run = CellRun(link.status, evalue=link.detail, seconds=run.seconds)
        text = out.getvalue()
        if record:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=_cut(text, self.limits.max_output))] \
                if text else []
            if run.status == "error":
                cell.outputs.append(nbformat.v4.new_output("error", ename=run.ename, evalue=run.evalue, traceback=[]))
            self.runs[i] = run
        self.grader_error = f"{run.ename}: {run.evalue}" if run.status == "error" else run.status
        return "killed" if link.status in ("killed", "died") else ("ok" if run.status == "ok" else run.status)

    async def serve(self, token: str, deadline: float) -> tuple[str, str]:
        """Run kernel.serve(token) in the kernel while a test cell talks to it; (status, detail) at its end."""
        folder = EXCHANGE_PATH if self.sandbox is not None else str(self.exchange)   # as the kernel sees it
        code = f"__import__('zeroedu.grading.kernel', fromlist=['serve']).serve({token!r}, {folder!r})"
        cell = nbformat.v4.new_code_cell(code)
        replies: dict[int, dict] = {}
        client = self.client
        assert client is not None
        first = self.nb.cells[0]  # async_execute_cell stores the cell it ran at the index it is given
        timeout = max(1.0, deadline - time.monotonic())
        client.timeout = int(timeout + 0.999)
        client.error_on_timeout = {"ename": TIMEOUT_ENAME, "evalue": f"{timeout:g}", "traceback": []}
        saved = client.on_cell_executed
        client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.update(
            {0: (execute_reply or {}).get("content", {})})
        try:
            await client.async_execute_cell(cell, 0)
        except DeadKernelError:
            return "died", self._kernel_tail()
        finally:
            client.on_cell_executed = saved
            self.nb.cells[0] = first
        reply = replies.get(0, {})
        if reply.get("ename") == TIMEOUT_ENAME:
            if not await self._responsive(client):
                self._kill()
                return "killed", f"{timeout:.0f}"
            return "timeout", f"{timeout:.0f}"
        return "ok", ""

    async def _kernel_cell(self, client: _Client, replies: dict, i: int, record: bool = True) -> str:
        cell = self.nb.cells[i]
        timeout = max(1.0, min(self.limits.cell_timeout, self.left()))
        client.timeout = int(timeout + 0.999)
        client.error_on_timeout = {"ename": TIMEOUT_ENAME, "evalue": f"{timeout:g}", "traceback": []}
        replies.pop(i, None)
        t0 = time.monotonic()
        self.log_offset = self._log_size()
        try:
            await client.async_execute_cell(cell, i)
        except DeadKernelError:
            run = CellRun("died", evalue=self._kernel_tail())
            if record:
                self.runs[i] = run
            return "died"
        reply = replies.get(i, {})
        run = CellRun("ok", seconds=time.monotonic() - t0)
        if reply.get("status") == "error":
            run = CellRun("error", str(reply.get("ename", ""))[:200], _cut(str(reply.get("evalue", "")),
                                                                         self.limits.max_output), run.seconds)
        if run.ename == TIMEOUT_ENAME:
            run.status = "timeout"
            if not await self._responsive(client):
                run.status = "killed"
                self._kill()
        if record:
            self.runs[i] = run
        return run.status

    async def _setup(self, client: _Client) -> str:
        """Run the notebook's grader_setup code (imports, the forkserver) before any learner cell: start-up time
        is not the learner's, so it gets STARTUP_SECONDS, not the per-cell limit. Returns a problem or ''."""
        code = self.nb.metadata.get("zeroedu", {}).get("grader_setup") or DEFAULT_SETUP
        # +1: the grader's own cap must see the crossing to note it; the kernel's only stops the flood
        cell = nbformat.v4.new_code_cell(OUTPUT_CAP.format(budget=self.limits.max_output + 1) + "\n" + code)
        first = self.nb.cells[0]
        client.timeout = STARTUP_SECONDS
        client.interrupt_on_timeout = False
        try:
            await client.async_execute_cell(cell, 0)
        except Exception as e:  # CellTimeoutError, DeadKernelError
            why = f"{type(e).__name__}: {str(e)[:200]}"
            return tr(f"the grader's set-up code did not run in the kernel ({why})",
                      f"评分器的准备代码没能在 kernel 中运行（{why}）")
        finally:
            client.interrupt_on_timeout = True
            self.nb.cells[0] = first
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        if errors:
            why = f"{errors[0]['ename']}: {errors[0]['evalue']}"
            return tr(f"the grader's set-up code failed: {why}", f"评分器的准备代码出错：{why}")
        return ""

    async def _responsive(self, client: _Client) -> bool:
        """After an interrupt: does the kernel run a trivial cell again within PROBE_SECONDS?"""
        probe = nbformat.v4.new_code_cell("pass")
        first = self.nb.cells[0]  # async_execute_cell stores the cell it ran at the index it is given
        client.timeout = int(PROBE_SECONDS)
        client.interrupt_on_timeout = False
        try:
            await client.async_execute_cell(probe, 0)
            return True
        except Exception:  # CellTimeoutError, DeadKernelError
            return False
        finally:
            client.interrupt_on_timeout = True
            self.nb.cells[0] = first

    def _label(self, i: int) -> str:
        gid = self.nb.cells[i].metadata.get("zeroedu_grade", {}).get("grade_id")
        return f"'{gid}'" if gid else tr("a cell you added", "你添加的一个单元格")

    def _log_size(self) -> int:
        return self.log.received if self.log is not None else 0

    def _kernel_tail(self) -> str:
        """The last line the kernel wrote to its stderr while the fatal cell ran."""
        data = self.log.since(self.log_offset) if self.log is not None else b""
        text = data.decode(errors="replace").strip().splitlines()
        last = text[-1] if text else ""
        return tr(f"last kernel message: {last[:200]}", f"kernel 最后一条消息：{last[:200]}") if last else tr(
            "no message: os._exit, a crash in native code, or the out-of-memory killer",
            "没有消息：可能是 os._exit、原生代码崩溃，或被 OOM killer 杀掉")
