"""A launch's run folder, and the folders that killed launches left behind.

Each launch works in a folder of its own under the temporary directory, `zeroedu-launch-*`: the ranks' status
slots (`status`), each rank's `rank<N>.stdout`, `rank<N>.stderr` and `rank<N>.stack`, and `owner`, the process
that started the launch. launch() removes its folder when it ends, however it ends, except when its process is
killed by SIGKILL: the next launch finds such a folder by its owner, gone, and removes it. The same goes for the
`pymp-*` folder that multiprocessing makes for the forkserver's socket: a launching process records it, and the
next launch removes it once that process is gone.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

RUN_DIR_PREFIX = "zeroedu-launch-"


def process_identity(pid: int) -> str:
    """"PID START": START is when the process started (Linux: clock ticks after boot, /proc/PID/stat), so that
    a new process that got the same pid is not taken for the old one. Empty if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid} {f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except OSError:
        pass   # alive, another user's
    return f"{pid} ?"


def remove_stale_run_dirs() -> list[str]:
    """Delete the folders of launches whose process is gone (killed by SIGKILL, which no cleanup survives), and
    say so on stderr. A folder without an owner file (being created, or from an older zeroedu) is left alone."""
    root = tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(RUN_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "owner")) as f:
                owner = f.read().strip()
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue
        now = process_identity(pid)
        if now and (now == owner or now.endswith(" ?") or owner.endswith(" ?")):
            continue                        # its launch is still running
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
                   if os.path.isfile(os.path.join(d, f)))
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            print(f"zeroedu launch: removed {path} ({size:,} bytes), left by a launch whose process (pid {pid}) "
                  "was killed before it could clean up", file=sys.stderr, flush=True)
    return removed


_PYMP_MARK = "zeroedu-pymp-"   # + pid: "PID START\n/tmp/pymp-xxxx", the multiprocessing folder of a launching process


def note_forkserver_dir() -> None:
    """Record this process's multiprocessing folder (the forkserver's socket lives there), so that the next
    launch can remove it if this process is killed by SIGKILL, which multiprocessing's own cleanup never sees."""
    import multiprocessing.util

    mark = os.path.join(tempfile.gettempdir(), f"{_PYMP_MARK}{os.getpid()}")
    folder = multiprocessing.util.get_temp_dir()
    text = f"{process_identity(os.getpid())}\n{folder}"
    try:
        with open(mark) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    try:
        with open(mark, "w") as f:
            f.write(text)
    except OSError:
        pass


def remove_stale_forkserver_dirs() -> list[str]:
    """Delete the `pymp-*` folders that launching processes now gone recorded (note_forkserver_dir): a killed
    kernel's. Folders that zeroedu did not record are never touched."""
    root, removed = tempfile.gettempdir(), []
    try:
        marks = [os.path.join(root, n) for n in os.listdir(root) if n.startswith(_PYMP_MARK)]
    except OSError:
        return removed
    for mark in marks:
        try:
            with open(mark) as f:
                owner, folder = f.read().split("\n", 1)
            pid = int(owner.split()[0])
        except (OSError, ValueError, IndexError):
            continue
        now = process_identity(pid)
        if now and (now == owner or now.endswith(" ?") or owner.endswith(" ?")):
            continue                        # still running
        if os.path.basename(folder).startswith("pymp-") and os.path.dirname(folder) == root:
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                removed.append(folder)
        try:
            os.remove(mark)
        except OSError:
            pass
    return removed
