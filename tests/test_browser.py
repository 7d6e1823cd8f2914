"""A real browser drives a real JupyterLab through a course notebook: run every cell from the Run menu, then
use its memory calculator as a learner would (type N, drag the ZeRO stage slider with the keyboard) and read
the bytes per rank it prints after each change.

What this catches that nbval cannot: the widgets lab extension missing or broken (the calculator shows as the
text "VBox(...)"), widget callbacks whose output never reaches the page, a notebook that fails when run from
JupyterLab's own kernel. The browser is Debian's chromium (scripts/install_chromium.sh; .ci/run installs it),
driven by Python playwright through executable_path: no browser is ever downloaded. Everything listens on
127.0.0.1, with a token, in a temp root.

A screenshot of the calculator after the slider moved is saved to out/browser/ (gitignored), and one of the
page as it was whenever the test fails. The expected bytes come from the ZeRO paper's Figure 1 formula, written
out below, not from zeroedu.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_memory_anatomy.ipynb"
ARTIFACTS = ROOT / "out" / "browser"
CHROMIUM = os.environ.get("ZEROEDU_CHROMIUM", "/usr/bin/chromium")
JUPYTER_LAB = Path(sys.executable).with_name("jupyter-lab")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SERVER_START_S = 30.0
UI_TIMEOUT_MS = 30_000        # kernel start + `import zeroedu` (torch) on a busy 2-core machine
RUN_ALL_TIMEOUT_MS = 180_000  # the whole notebook from the page: ~12 s here; nbval took 84 s of wall time at load 16

# the notebook's calculator: memory_calculator(psi=7e9, world_size=8, stage=0, precision="bf16", ...)
PSI, N_START, STAGE_START, N_TYPED = 7_000_000_000, 8, 0, 64
TOTAL = re.compile(r"device\s+total\s+([\d,]+) B")


def zero_bytes_per_rank(psi: int, n: int, stage: int, k: int = 12) -> int:
    """ZeRO paper, Figure 1, mixed-precision Adam: 2 (fp16 params) + 2 (fp16 grads) + K (fp32 master and moments)
    bytes per parameter; stage 1 partitions the K bytes over N ranks, stage 2 the gradients too, stage 3 all."""
    params, grads, optim = 2 * psi, 2 * psi, k * psi
    return (params // n if stage >= 3 else params) + (grads // n if stage >= 2 else grads) + \
        (optim // n if stage >= 1 else optim)


def _skip_reason() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return (f"no Chromium at {CHROMIUM}: run scripts/install_chromium.sh (as root, Debian/Ubuntu) or set "
                "ZEROEDU_CHROMIUM to a Chromium binary")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright is not installed: pip install -e '.[test]'"
    if not JUPYTER_LAB.exists():
        return f"no {JUPYTER_LAB}: JupyterLab is not installed in this environment"
    return None


pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())), pytest.mark.slow,
              pytest.mark.timeout(360)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of pid, from /proc (the kernels the server started: they run in sessions of their own)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is dead for our purposes
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    return True


class JupyterLab:
    """JupyterLab on 127.0.0.1:<free port> with a token, serving `root`; config, data and settings under `home`
    so that nothing from the user's ~/.jupyter changes what the test sees.

    start() returns at once (the browser starts meanwhile), wait() blocks until the server answers, stop()
    shuts it and its kernels down whatever state they are in.
    """

    def __init__(self, root: Path, home: Path) -> None:
        self.token = secrets.token_hex(16)
        config = home / "config"
        (config / "labconfig").mkdir(parents=True)
        # no "get Jupyter news?" toast over the notebook in the screenshot, and no check whether the lab assets
        # need a rebuild (seconds of server CPU on every page load; the assets ship prebuilt)
        (config / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
             "buildCheck": False, "buildAvailable": False}))
        self.env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_DATA_DIR": str(home / "data"),
                    "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
                    "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "IPYTHONDIR": str(home / "ipython"),
                    "PYTHONPATH": str(ROOT)}  # the kernel imports this checkout's zeroedu, installed or not
        self.root, self.log_path = root, home / "jupyterlab.log"
        self.cmd = [str(JUPYTER_LAB), "--no-browser", "--ServerApp.ip=127.0.0.1", "--ServerApp.port_retries=0",
                    f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
                    "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=",
                    "--ServerApp.terminals_enabled=False",
                    "--ServerApp.jpserver_extensions={'jupyter_lsp': False}",  # no language servers to scan for
                    *(["--allow-root"] if os.geteuid() == 0 else [])]
        self.server: subprocess.Popen | None = None
        self.base = ""

    def start(self) -> None:
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        with open(self.log_path, "wb") as log:
            self.server = subprocess.Popen([*self.cmd, f"--ServerApp.port={port}"], stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                           cwd=self.root, start_new_session=True)

    def wait(self, tries: int = 3) -> None:
        """Until the server answers. The free port can be taken between our probe and the server's bind: then
        start again on another one."""
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.server.poll() is not None:
                log = self.log_path.read_text()
                if "already in use" in log and tries > 1:
                    self.start()
                    return self.wait(tries - 1)
                raise AssertionError(f"JupyterLab exited with {self.server.returncode} before answering:\n"
                                     f"{log[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise AssertionError(f"JupyterLab did not answer on {self.base} within {SERVER_START_S:.0f} s:\n"
                                     f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.25)

    def url(self, path: str) -> str:
        return f"{self.base}/{path}?token={self.token}"

    def stop(self) -> None:
        """Stop the kernels (nothing in them to save), ask the server to shut down, then insist; no kernel may
        outlive the test."""
        if self.server is None:
            return
        kernels = _children(self.server.pid)
        for pid in kernels:  # the server's polite kernel shutdown waits seconds for each; SIGTERM is enough
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(OSError):
            req = urllib.request.Request(self.url("api/shutdown"), method="POST", data=b"")
            urllib.request.urlopen(req, timeout=5).close()
        try:
            self.server.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait(5)
        for pid in kernels:
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # kernels lead their own session: kill it whole


@contextlib.contextmanager
def jupyterlab(root: Path, home: Path) -> Iterator[JupyterLab]:
    lab = JupyterLab(root, home)
    try:
        lab.start()
        yield lab
    finally:
        lab.stop()


def _kernel_state(lab: JupyterLab, notebook: str) -> str | None:
    """execution_state of the kernel of notebook's session, from the server's REST API; None while it has none."""
    with urllib.request.urlopen(lab.url("api/sessions"), timeout=5) as r:
        sessions = json.load(r)
    for session in sessions:
        if session.get("path") == notebook and session.get("kernel"):
            return session["kernel"].get("execution_state")
    return None


def _start_kernel(page, lab: JupyterLab) -> None:
    """Wait until the notebook's kernel is up and idle. JupyterLab 4 may first ask which kernel to start (the
    "Select Kernel" dialog): answer it with the preferred kernel, as a learner would."""
    select = page.locator(".jp-Dialog", has_text="Select Kernel")
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while _kernel_state(lab, NOTEBOOK.name) != "idle":
        if select.is_visible():
            select.locator(".jp-Dialog-button.jp-mod-accept").click()  # "Select"
        assert time.monotonic() < deadline, "the notebook's kernel did not start and become idle"
        page.wait_for_timeout(200)
    select.wait_for(state="hidden")
    # the page has connected to it too: the toolbar's kernel indicator says idle
    page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()


def _per_rank_total(text: str) -> int:
    found = TOTAL.search(text)
    assert found, f"no 'device total' line in the calculator's output:\n{text}"
    return int(found.group(1).replace(",", ""))


def _run_all_cells(page) -> None:
    """Run > Run All Cells, as a learner would, then wait until every code cell has run and none failed."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    # every code cell whose input shows: the hosted-setup cell at the top opens collapsed (its source hidden), so
    # it has no prompt to read; it does nothing on a machine where zeroedu is installed
    prompts = page.locator(".jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt")
    total = prompts.count()
    assert total >= 10, f"only {total} code cells show a prompt"
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_MS / 1000
    while True:
        texts = prompts.all_text_contents()  # DOM text: off-screen cells (content-visibility) render no inner text
        done = sum(bool(re.fullmatch(r"\[\d+\]:", t.strip())) for t in texts)
        failed = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
        assert failed.count() == 0, f"a cell failed when run from JupyterLab:\n{failed.first.inner_text()[:3000]}"
        if done == total:
            return
        assert time.monotonic() < deadline, f"{done} of {total} code cells ran within {RUN_ALL_TIMEOUT_MS} ms"
        page.wait_for_timeout(250)


def test_memory_calculator_in_jupyterlab(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    assert NOTEBOOK.is_file(), f"{NOTEBOOK.relative_to(ROOT)} is missing: the browser test runs that course notebook"
    expect.set_options(timeout=UI_TIMEOUT_MS)
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{NOTEBOOK.stem}-calculator.png"
    failure_shot = ARTIFACTS / f"{NOTEBOOK.stem}-failure.png"
    for old in (shot, failure_shot):
        old.unlink(missing_ok=True)
    t0 = time.monotonic()
    phases: list[str] = []  # where the time goes, printed at the end (pytest -s) to keep the test fast

    def phase(name: str) -> None:
        phases.append(f"{name} {time.monotonic() - t0:.1f}s")

    with jupyterlab(root, tmp_path / "home") as lab, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            phase("browser")
            try:
                lab.wait()
                phase("server")
                page.goto(lab.url(f"lab/tree/{NOTEBOOK.name}"), wait_until="domcontentloaded")
                page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
                phase("notebook")
                _start_kernel(page, lab)
                phase("kernel")
                _run_all_cells(page)
                phase("run all")

                # the calculator: a rendered widget (not the text "VBox(...)"), showing the notebook's settings
                calculator = page.locator(".jp-NotebookPanel .jp-CodeCell",
                                          has=page.locator(".widget-slider", has_text="ZeRO stage"))
                output = calculator.locator(".widget-html pre")
                slider = calculator.locator(".widget-slider", has_text="ZeRO stage")
                ranks = calculator.locator(".widget-text", has_text="N (ranks)").locator("input")
                expect(output).to_contain_text(f"N = {N_START}, stage {STAGE_START}")
                assert _per_rank_total(output.inner_text()) == zero_bytes_per_rank(PSI, N_START, STAGE_START)

                # type N, as a learner would: stage 0 replicates everything, so bytes per rank stay 16 psi
                ranks.fill(str(N_TYPED))
                ranks.press("Enter")
                expect(output).to_contain_text(f"N = {N_TYPED}, stage {STAGE_START}")
                assert _per_rank_total(output.inner_text()) == zero_bytes_per_rank(PSI, N_TYPED, STAGE_START)
                phase("typed N")

                # drag the stage slider with the keyboard: each step right shards one more model state
                slider.locator(".noUi-handle").focus()
                seen = [_per_rank_total(output.inner_text())]
                for stage in range(STAGE_START + 1, 4):
                    page.keyboard.press("ArrowRight")
                    expect(slider.locator(".widget-readout")).to_have_text(str(stage))
                    expect(output).to_contain_text(f"N = {N_TYPED}, stage {stage}")
                    seen.append(_per_rank_total(output.inner_text()))
                want = [zero_bytes_per_rank(PSI, N_TYPED, s) for s in range(STAGE_START, 4)]
                assert seen == want, (seen, want)
                assert len(set(seen)) == len(seen)  # every move changed the printed result
                phase("slider")
                calculator.screenshot(path=str(shot))
            except Exception:
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(failure_shot), full_page=True)
                raise
        finally:
            browser.close()
            phase("browser closed")

    assert shot.stat().st_size > 10_000, "the screenshot is suspiciously small"
    phase("server stopped")
    print(f"browser test: {', '.join(phases)}; screenshot {shot.relative_to(ROOT)}")
