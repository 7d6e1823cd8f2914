"""Each graded notebook's kernel in its own bubblewrap sandbox (Debian/Ubuntu package `bubblewrap`).

Inside, the kernel and everything it starts (ranks, subprocesses) see:
- the whole system and the Python environment read-only (`--ro-bind / /`), with a private /tmp;
- one writable folder: the notebook's work folder (a copy of the submission and nothing else);
- no solutions: the --solutions folder, the `solutions/` beside the zeroedu package and its git history,
  and every submission being graded are covered by empty folders;
- no network (`--unshare-net`; the grader talks to the kernel over unix sockets in a folder of their own), its
  own process tree (`--unshare-pid`: when the kernel goes, every process it started goes too, a new session
  or not);
- limits per process: address space (--memory), processes of the sandbox's user (--max-processes), CPU time,
  no core files. When the grader runs as root the kernel runs as an unprivileged user (65534), so that the
  process limit holds and nothing inside has root's rights.

The grader's own files (the settings of the exercise's blocks, the kernel's log pipe) stay outside: the
settings are bound read-only, the log is a pipe the grader reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroedu.grading.kernel import CONFIG_PATH

SANDBOX_UID = 65534          # "nobody": the kernel's user when the grader runs as root
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`, Fedora: `sudo dnf install "
                "bubblewrap`, or scripts/install_bwrap.sh), or grade your own notebooks with --trusted")

# Runs first inside the sandbox, with `python -I -S` (no site: no sitecustomize, nothing from the venv): set the
# limits, leave root, then become the kernel.
_INIT = """
import os, resource, sys
mem, nproc, cpu, uid = (int(v) for v in sys.argv[1:5])
for what, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CPU, cpu)):
    if value > 0:
        resource.setrlimit(what, (value, value))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if uid >= 0 and os.getuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
os.environ.pop("JPY_PARENT_PID", None)  # the kernel's parent pid means nothing in this pid namespace
os.execv(sys.argv[5], sys.argv[5:])
"""


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
    processes: int = 1024          # processes and threads of the sandbox's user
    cpu_seconds: int = 3600        # CPU time per process


@dataclass
class Sandbox:
    """One notebook's sandbox: what is writable, what is hidden, the limits."""

    workdir: Path
    sockets: Path                  # the kernel's unix sockets and connection file
    config: Path                   # the grader's settings, bound read-only at kernel.CONFIG_PATH
    hidden: list[Path] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)

    def prepare(self) -> None:
        """Folders the kernel writes must belong to its user."""
        from zeroedu.grading.kernel import EXCHANGE

        self.sockets.mkdir(parents=True, exist_ok=True)
        (self.workdir / ".home").mkdir(exist_ok=True)
        (self.workdir / EXCHANGE).mkdir(exist_ok=True)
        if os.geteuid() == 0:
            for folder in (self.workdir, self.sockets):
                for path in [folder, *folder.rglob("*")]:
                    os.lchown(path, SANDBOX_UID, SANDBOX_UID)
        os.chmod(self.config, 0o644)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        home = str(self.workdir / ".home")
        return {**env, "HOME": home, "IPYTHONDIR": f"{home}/.ipython", "MPLCONFIGDIR": f"{home}/.matplotlib",
                "JUPYTER_RUNTIME_DIR": f"{home}/.jupyter", "XDG_CACHE_HOME": f"{home}/.cache"}

    def command(self, cmd: list[str]) -> list[str]:
        exe = bwrap()
        if exe is None:
            raise RuntimeError(f"bubblewrap is not installed: {INSTALL_HINT}")
        args = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs",
                "/dev/shm", "--perms", "1777", "--tmpfs", "/tmp", "--perms", "0755", "--tmpfs", "/run"]
        args += _reachable(_needed(), closed_parents=os.geteuid() == 0)
        for path in self.hidden:   # after the binds above: a folder bound back (a course under /tmp) stays hidden
            if path.is_dir():
                args += ["--tmpfs", str(path)]
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        for path in (self.workdir, self.sockets, Path(CONFIG_PATH)):  # bwrap would make missing parents 0700
            args += [a for d in reversed(path.parents) if d.parent != d and d not in (Path("/tmp"), Path("/run"))
                     and (Path("/tmp") in d.parents or Path("/run") in d.parents)
                     for a in ("--perms", "0755", "--dir", str(d))]
        args += ["--bind", str(self.workdir), str(self.workdir), "--bind", str(self.sockets), str(self.sockets),
                 "--ro-bind", str(self.config), CONFIG_PATH,
                 "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 *([] if os.geteuid() == 0 else ["--unshare-user"]),
                 "--die-with-parent", "--new-session", "--chdir", str(self.workdir)]
        uid = SANDBOX_UID if os.geteuid() == 0 else -1
        init = [sys.executable, "-I", "-S", "-c", _INIT, str(self.limits.memory), str(self.limits.processes),
                str(self.limits.cpu_seconds), str(uid)]
        return [*args, "--", *init, *cmd]

    def kernel_manager(self, client: Any) -> Any:
        """A kernel manager whose kernel starts in this sandbox and talks over unix sockets."""
        from jupyter_client.manager import AsyncKernelManager

        sandbox = self

        class Sandboxed(AsyncKernelManager):
            def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
                cmd = super().format_kernel_cmd(extra_arguments)
                if os.geteuid() == 0:
                    os.chown(self.connection_file, SANDBOX_UID, SANDBOX_UID)
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
    history) and the submissions and reports of the run. A folder holding the Python environment or the
    package itself cannot be covered; its notebooks are covered one by one instead."""
    from zeroedu.grading.build import ROOT

    keep = [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), ROOT / "zeroedu"]
    out: list[Path] = []
    candidates = [solutions, ROOT / "solutions", *_git_dirs(ROOT), *inputs, *outputs]
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
