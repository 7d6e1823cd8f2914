"""Installed by `zeroedu grade` in the kernel of a graded notebook, and in every Python process it starts.

The grader puts this folder first on PYTHONPATH, so Python imports this file at start-up (the `site` module
imports `sitecustomize`): the notebook kernel, multiprocessing's forkserver and the ranks forked from it all
get the hook before any learner code runs.

The hook (sys.addaudithook) refuses to delete, rename over, truncate or overwrite a file outside the
notebook's working directory, raises PermissionError with the reason, and appends one JSON line per refusal to
the grader's log. It guards against accidents (a cleanup with the wrong path), not against an adversary: audit
hooks do not see ctypes calls, subprocesses of other programs (rm), or writes through a file descriptor opened
elsewhere. Use a container or a throwaway VM to grade code you do not trust.
"""

import json
import os
import sys

_ROOT = os.environ.get("ZEROEDU_GRADE_ROOT")
_LOG = os.environ.get("ZEROEDU_GRADE_LOG")
_ALLOWED = ("/dev/", "/proc/self/")  # /dev/null, /dev/shm semaphores, our own fds


def _absolute(path, dir_fd=None):
    path = os.fsdecode(path)
    if not os.path.isabs(path):
        base = os.getcwd()
        if dir_fd is not None:
            try:
                base = os.readlink(f"/proc/self/fd/{dir_fd}")
            except OSError:
                pass
        path = os.path.join(base, path)
    # Resolve the folder, not the file: removing a symlink that points outside only removes the link.
    head, tail = os.path.split(os.path.normpath(path))
    return os.path.join(os.path.realpath(head), tail)


def _outside(path, dir_fd=None):
    if isinstance(path, int) or path is None:
        return None
    try:
        full = _absolute(path, dir_fd)
    except (TypeError, ValueError, OSError):
        return None
    root = os.path.realpath(_ROOT)
    if full == root or full.startswith(root + os.sep) or full.startswith(_ALLOWED):
        return None
    return full


_busy = False


def _refuse(what, path):
    global _busy
    if _LOG:
        _busy = True  # our own write to the log raises an "open" event too
        try:
            line = json.dumps({"op": what, "path": path, "pid": os.getpid()}) + "\n"
            fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError:
            pass
        finally:
            _busy = False
    raise PermissionError(f"zeroedu grader: refused to {what} {path}: it is outside this notebook's working "
                          f"directory {_ROOT}. Graded code may only change files under its own folder.")


def _hook(event, args):
    if _busy:
        return
    if event in ("os.remove", "os.rmdir", "shutil.rmtree"):
        full = _outside(args[0], args[1] if len(args) > 1 else None)
        if full:
            _refuse("delete", full)
    elif event == "os.rename":  # os.rename and os.replace: the source goes away, the target is overwritten
        src, dst = args[0], args[1]
        src_fd = args[2] if len(args) > 2 else None
        dst_fd = args[3] if len(args) > 3 else None
        for path, fd, what in ((src, src_fd, "move away"), (dst, dst_fd, "replace")):
            full = _outside(path, fd)
            if full and (what == "move away" or os.path.lexists(full)):
                _refuse(what, full)
    elif event == "os.truncate":
        full = _outside(args[0])
        if full:
            _refuse("truncate", full)
    elif event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        truncates = ("w" in mode) if isinstance(mode, str) else bool((flags or 0) & os.O_TRUNC)
        if truncates:
            full = _outside(path)
            if full and os.path.exists(full):
                _refuse("overwrite", full)


if _ROOT:
    sys.addaudithook(_hook)
