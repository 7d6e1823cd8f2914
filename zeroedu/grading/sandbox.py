"""Each graded notebook's kernel in its own bubblewrap sandbox (Debian/Ubuntu package `bubblewrap`).

Inside, the kernel and everything it starts (ranks, subprocesses) see:
- the whole system and the Python environment read-only (`--ro-bind / /`), with a private /tmp;
- one writable folder: the notebook's work folder (a copy of the submission and nothing else);
- no solutions: the --solutions folder, the `solutions/` beside the zeroedu package and its git history,
  and every submission being graded are covered by empty folders;
- no network (`--unshare-net`; the grader talks to the kernel over unix sockets in a folder of their own), its
  own process tree (`--unshare-pid`: when the kernel goes, every process it started goes too, a new session
  or not);
- limits: address space per process (--memory), processes and threads of the sandbox's user
  (--max-processes), CPU time, no core files, FILE_BYTES per file written, and sized tmpfs for /tmp, /dev/shm
  and /run (TMPFS_BYTES). When the grader runs as root each sandbox runs as a user of its own (sandbox_uid: a
  fresh uid per sandbox, not 65534 for all), so the process limit is per notebook and nothing inside has
  root's rights. A notebook's total memory across its processes (ranks, tmpfs pages included) and its
  process count are capped by cgroups of its own (Cgroup) where the host lets a root grader make them: cgroup
  v1's memory and pids controllers, as in this course's container. Where it does not (a host with cgroup v2
  only, or a grader not run as root) only the per-process limits hold; capping a notebook's total there needs
  a cgroup v2 subtree with the memory and pids controllers delegated to the grader, which the grader does not
  use yet. `cgroup_note()` says once which of these holds. Not capped anywhere: the disk its work folder takes
  (only each file, FILE_BYTES).
- the grader's test exchange (exchange_dir): two named pipes per test, made by the grader in a folder only it
  can write, bound read-only at EXCHANGE_PATH (pipes open for writing on a read-only mount): nothing the
  learner can name (a link at the old place in the work folder) is followed by the grader.

The grader's own files (the settings of the exercise's blocks, the kernel's log pipe) stay outside: the
settings are bound read-only, the log is a pipe the grader reads.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroedu.grading.kernel import CONFIG_PATH, EXCHANGE_PATH

SANDBOX_UID = 65534          # "nobody": the kernel's user when the grader does not run as root (unused then)
UID_BASE = 1_600_000_000     # as root, sandbox k of grader process p runs as UID_BASE + p % 100000 * 1000 + k % 1000
FILE_BYTES = 2 * 2**30       # RLIMIT_FSIZE: the largest file a sandboxed process may write
TMPFS_BYTES = {"/tmp": 2 * 2**30, "/dev/shm": 2 * 2**30, "/run": 64 * 2**20}
_uids = itertools.count()
_uid_lock = threading.Lock()


def sandbox_uid() -> int:
    """A uid no other sandbox of this grader uses (and, with the pid in it, none of a concurrent grader)."""
    with _uid_lock:
        return UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uids) % 1000
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`, Fedora: `sudo dnf install "
                "bubblewrap`, or scripts/install_bwrap.sh), or grade your own notebooks with --trusted")

# Runs first inside the sandbox, with `python -I -S` (no site: no sitecustomize, nothing from the venv): set the
# limits, leave root, then become the kernel.
_INIT = """
import os, resource, sys
mem, nproc, cpu, fsize, uid = (int(v) for v in sys.argv[1:6])
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CPU, cpu),
                    (resource.RLIMIT_FSIZE, fsize)):
    if value > 0:
        resource.setrlimit(what, (value, value))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if uid >= 0 and os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.environ.pop("JPY_PARENT_PID", None)  # the kernel's parent pid means nothing in this pid namespace
os.execv(sys.argv[6], sys.argv[6:])
"""


def cgroup_note() -> str:
    """One sentence for the instructor: what caps a notebook's use on this machine."""
    v1 = os.geteuid() == 0 and all((CGROUP_V1 / c / "cgroup.procs").exists() for c in ("memory", "pids"))
    if v1:
        return ("each notebook runs in cgroups of its own (v1 memory and pids controllers): its processes together "
                "are capped in memory and number; each process by address space (--memory-gb) and CPU time, its "
                "/tmp, /dev/shm and /run by size, each file it writes by size; the disk its work folder takes is "
                "not capped")
    return ("no cgroup this grader can make here (cgroup v2 only, or not root): each notebook's memory is capped per "
            "process (--memory-gb), its /tmp, /dev/shm and /run by size and each file it writes by size; a notebook's "
            "processes together, and the disk its work folder takes, are not capped (that needs a cgroup v2 subtree "
            "delegated to the grader)")


def bwrap() -> str | None:
    return shutil.which("bwrap")


def check() -> tuple[bool, str]:
    """Can this machine run the sandbox? (ok, one line saying why not)."""
    exe = bwrap()
    if exe is None:
        return False, "bubblewrap (bwrap) is not installed"
    cmd = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net", "--unshare-pid",
           "--die-with-parent", *([] if os.geteuid() == 0 else ["--unshare-user"]), "--", "/bin/true"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap did not run: {e}"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return False, f"bwrap is installed but cannot create a sandbox here ({why[:200]})"
    return True, f"bubblewrap works ({exe})"


@dataclass
class Limits:
    memory: int = 6 * 2**30        # bytes of address space per process (torch alone maps ~2 GiB)
    processes: int = 1024          # processes and threads of the sandbox's user (and of its cgroup, if any)
    cpu_seconds: int = 3600        # CPU time per process
    notebook_memory: int = 8 * 2**30   # memory of all the notebook's processes together, where a cgroup can cap it


CGROUP_V1 = Path("/sys/fs/cgroup")
# Runs before bwrap, outside the sandbox and still as the grader's user: joins the notebook's cgroups (every process
# the sandbox starts inherits them), then becomes bwrap.
_JOIN = """
import os, sys
end = sys.argv.index("--")
for procs in sys.argv[1:end]:
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
os.execv(sys.argv[end + 1], sys.argv[end + 1:])
"""


class Cgroup:
    """One notebook's cgroups where this host lets the grader make them: cgroup v1's memory controller (a cap on
    the memory of all the notebook's processes together, tmpfs pages included: past it the kernel's OOM killer
    ends one of them) and pids controller (a cap on its processes and threads). Found here: a container with the
    v1 hierarchies mounted writable for root. `make()` returns None where they are not (cgroup v2 only, not root):
    the per-process limits still hold, a notebook's total does not."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders

    @classmethod
    def make(cls, name: str, limits: Limits) -> Cgroup | None:
        memory, pids = CGROUP_V1 / "memory", CGROUP_V1 / "pids"
        if os.geteuid() != 0 or not (memory / "cgroup.procs").exists() or not (pids / "cgroup.procs").exists():
            return None
        made: list[Path] = []
        try:
            for root in (memory, pids):
                (root / name).mkdir()
                made.append(root / name)
            (memory / name / "memory.limit_in_bytes").write_text(str(limits.notebook_memory))
            swap = memory / name / "memory.memsw.limit_in_bytes"   # RAM plus swap: no escape into swap
            if swap.exists():
                swap.write_text(str(limits.notebook_memory))
            (pids / name / "pids.max").write_text(str(limits.processes))
        except OSError:
            cls(made).remove()
            return None
        return cls(made)

    def join_command(self, cmd: list[str]) -> list[str]:
        return [sys.executable, "-I", "-S", "-c", _JOIN, *(str(f / "cgroup.procs") for f in self.folders), "--",
                *cmd]

    def peak_memory(self) -> int | None:
        """The most memory the notebook's processes held at once (bytes), as the memory controller counted it."""
        for folder in self.folders:
            with contextlib.suppress(OSError, ValueError):
                return int((folder / "memory.max_usage_in_bytes").read_text())
        return None

    def remove(self) -> None:
        """Remove the cgroups once their processes are gone (the kernel killed, its pid namespace with it). A
        process of the notebook still in one (a fork bomb's children take a while to exit, more so on a busy
        machine) is killed: nothing a notebook started outlives its grading, and no empty cgroup is left."""
        for folder in self.folders:
            for attempt in range(300):   # 30 s at most
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:   # busy: a process is still in it, or leaving it
                    if attempt % 10 == 9:
                        _kill_members(folder)
                    time.sleep(0.1)
        self.folders = []


def _kill_members(folder: Path) -> None:
    """SIGKILL every process still in cgroup `folder` (they are the notebook's: the cgroup was made for it)."""
    with contextlib.suppress(OSError, ValueError):
        for pid in (folder / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


@dataclass
class Sandbox:
    """One notebook's sandbox: what is writable, what is hidden, the limits."""

    workdir: Path
    sockets: Path                  # the kernel's unix sockets and connection file
    config: Path                   # the grader's settings, bound read-only at kernel.CONFIG_PATH
    hidden: list[Path] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    exchange: Path | None = None   # the grader's folder of test pipes, bound read-only at kernel.EXCHANGE_PATH
    uid: int = field(default_factory=lambda: sandbox_uid() if os.geteuid() == 0 else -1)
    cgroup: Cgroup | None = None   # made with the first kernel, removed by close()
    _prepared: bool = False

    def prepare(self) -> None:
        """Folders the kernel writes must belong to its user. Only the grader's own entries are changed, never
        by following a path: on a replay the work folder holds whatever the last kernel left (links included)."""
        from zeroedu.grading.scratch import remove_tree

        self.sockets.mkdir(parents=True, exist_ok=True)
        # A fresh home for every kernel: an IPython startup file a learner wrote there must not run (and kill)
        # the next kernel. remove_tree removes a link put in its place without following it.
        home = self.workdir / ".home"
        remove_tree(home)
        home.mkdir()
        if self.uid >= 0:
            os.lchown(home, self.uid, self.uid)
            os.lchown(self.sockets, self.uid, self.uid)
            if not self._prepared:   # the first time, the work folder holds only the grader's copy
                os.lchown(self.workdir, self.uid, self.uid)
                for path in self.workdir.iterdir():
                    os.lchown(path, self.uid, self.uid)
        if self.cgroup is None:
            self.cgroup = Cgroup.make(f"zeroedu-grade-{os.getpid()}-{self.workdir.name}", self.limits)
        self._prepared = True
        os.chmod(self.config, 0o644)
        if self.exchange is not None:
            os.chmod(self.exchange, 0o711)   # the kernel may open a pipe it is told about, never list or add

    def env(self, env: dict[str, str]) -> dict[str, str]:
        home = str(self.workdir / ".home")   # emptied by prepare() before every kernel
        return {**env, "HOME": home, "IPYTHONDIR": f"{home}/.ipython", "MPLCONFIGDIR": f"{home}/.matplotlib",
                "JUPYTER_RUNTIME_DIR": f"{home}/.jupyter", "XDG_CACHE_HOME": f"{home}/.cache"}

    def command(self, cmd: list[str]) -> list[str]:
        exe = bwrap()
        if exe is None:
            raise RuntimeError(f"bubblewrap is not installed: {INSTALL_HINT}")
        args = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for mount, mode in (("/dev/shm", "1777"), ("/tmp", "1777"), ("/run", "0755")):
            args += ["--perms", mode, "--size", str(TMPFS_BYTES[mount]), "--tmpfs", mount]
        args += _reachable(_needed(), closed_parents=os.geteuid() == 0)
        for path in self.hidden:   # after the binds above: a folder bound back (a course under /tmp) stays hidden
            if path.is_dir():
                args += ["--tmpfs", str(path)]
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        inside = [self.workdir, self.sockets, Path(CONFIG_PATH)] + ([Path(EXCHANGE_PATH)] if self.exchange else [])
        for path in inside:  # bwrap would make missing parents 0700
            args += [a for d in reversed(path.parents) if d.parent != d and d not in (Path("/tmp"), Path("/run"))
                     and (Path("/tmp") in d.parents or Path("/run") in d.parents)
                     for a in ("--perms", "0755", "--dir", str(d))]
        args += ["--bind", str(self.workdir), str(self.workdir), "--bind", str(self.sockets), str(self.sockets),
                 "--ro-bind", str(self.config), CONFIG_PATH,
                 *(["--ro-bind", str(self.exchange), EXCHANGE_PATH] if self.exchange else []),
                 "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 *([] if os.geteuid() == 0 else ["--unshare-user"]),
                 "--die-with-parent", "--new-session", "--chdir", str(self.workdir)]
        init = [sys.executable, "-I", "-S", "-c", _INIT, str(self.limits.memory), str(self.limits.processes),
                str(self.limits.cpu_seconds), str(FILE_BYTES), str(self.uid)]
        full = [*args, "--", *init, *cmd]
        return self.cgroup.join_command(full) if self.cgroup is not None else full

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()

    def kernel_manager(self, client: Any) -> Any:
        """A kernel manager whose kernel starts in this sandbox and talks over unix sockets."""
        from jupyter_client.manager import AsyncKernelManager

        sandbox = self

        class Sandboxed(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
                cmd = super().format_kernel_cmd(extra_arguments)
                if sandbox.uid >= 0:
                    os.chown(self.connection_file, sandbox.uid, sandbox.uid)
                return sandbox.command(cmd)

        km = Sandboxed(kernel_name=client.kernel_name, transport="ipc", ip=str(self.sockets / "kernel"),
                       connection_file=str(self.sockets / "kernel.json"), cache_ports=False)
        # A signal to the process group would reach bwrap, not the kernel in its own session and pid namespace:
        # interrupt by message on the control channel (ipykernel then signals itself).
        km.kernel_spec.interrupt_mode = "message"
        return km


FRESH_TMPFS = (Path("/tmp"), Path("/run"), Path("/dev/shm"))   # Sandbox.command mounts an empty tmpfs on each


def _needed() -> list[Path]:
    """What the kernel must read: Python, the environment, zeroedu, PYTHONPATH."""
    from zeroedu.grading.build import ROOT

    paths = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent, ROOT,
             *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return [p.resolve() for p in paths if p.exists()]


def _reachable(paths: list[Path], closed_parents: bool = True) -> list[str]:
    """bwrap arguments that let the kernel read `paths`, read-only, where the sandbox would hide them:
    - under /tmp, /run or /dev/shm, which the sandbox replaces with empty tmpfs (a course cloned under /tmp);
    - with closed_parents (the kernel runs as another user), below a folder closed to others (Python under
      /root, mode 700): that folder becomes an empty tmpfs with just those paths bound into it.
    Everything else in such a folder (root's home, the rest of /tmp) stays out of sight."""
    args: list[str] = []
    for path in paths:
        if path in FRESH_TMPFS:   # never the whole of /tmp: only folders in it
            continue
        for above in reversed([path, *path.parents]):
            fresh = above in FRESH_TMPFS   # already an empty tmpfs in the sandbox
            if above != Path("/") and (fresh or (closed_parents and not above.stat().st_mode & 0o001)):
                if not fresh and str(above) not in args:
                    args += ["--perms", "0755", "--tmpfs", str(above)]
                for middle in reversed(path.parents):   # bwrap would make these 0700
                    if above in middle.parents:
                        args += ["--perms", "0755", "--dir", str(middle)]
                args += ["--ro-bind", str(path), str(path)]
                break
    return args


def hidden_paths(solutions: Path, inputs: list[Path], outputs: list[Path]) -> list[Path]:
    """What no sandbox may see: solutions (the folder given, the one beside the package, the package's git
    history), the course's tests (their fixtures hold correct answers) and the submissions and reports of the
    run. A folder holding the Python environment or the
    package itself cannot be covered; its notebooks are covered one by one instead."""
    from zeroedu.grading.build import ROOT

    keep = [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), ROOT / "zeroedu"]
    out: list[Path] = []
    candidates = [solutions, ROOT / "solutions", ROOT / "tests", *_git_dirs(ROOT), *inputs, *outputs]
    for path in candidates:
        path = Path(path).resolve()
        if not path.exists():
            continue
        if path.is_dir() and any(k == path or path in k.parents for k in keep):
            out += sorted(path.rglob("*.ipynb"))
        else:
            out.append(path)
    return list(dict.fromkeys(out))


def _git_dirs(root: Path) -> list[Path]:
    """The repository's .git, and for a worktree the common folder it points to."""
    git = root / ".git"
    if git.is_dir():
        return [git]
    if git.is_file():
        text = git.read_text(errors="replace").strip()
        if text.startswith("gitdir:"):
            target = (root / text.split(":", 1)[1].strip()).resolve()
            common = target / "commondir"
            base = (target / common.read_text().strip()).resolve() if common.is_file() else target
            return [git, base]
    return []
