"""Installed by `zeroedu grade` in the kernel of a graded notebook, and in every Python process it starts.

The grader puts this folder first on PYTHONPATH, so Python imports this file at start-up (the `site` module
imports `sitecustomize`): the notebook kernel, multiprocessing's forkserver and the ranks forked from it all
run it before any learner code.

It does two things:
1. The engine pieces the exercise asks the learner to write raise "write your own" when learner code reaches
   them (zeroedu.grading.kernel.apply_blocks, from the grader's read-only settings file).
2. An audit hook (sys.addaudithook) refuses to delete, rename over, truncate or open for writing a file outside
   the notebook's working directory, with a PermissionError that says why. Each refusal is written as one line
   to a copy of the stderr that the grader gave the kernel: a pipe, read by the grader outside the sandbox, so
   learner code cannot erase what was written (it can close that copy, and fd 2: later refusals then go
   unlogged, though still refused). Inside bubblewrap the operating system refuses those writes
   anyway (read-only mounts); the hook makes the message clear. Without the sandbox (`zeroedu grade --trusted`)
   it guards against accidents only: ctypes and other programs are not audited.
"""

import json
import os
import sys

MARK = "zeroedu-grade-refused "


def _install():
    root = os.environ.get("ZEROEDU_GRADE_ROOT")
    if not root:
        return
    try:
        from zeroedu.grading import kernel

        kernel.apply_blocks()
    except Exception as e:  # never stop the interpreter from starting; the grader sees the message
        sys.stderr.write(f"zeroedu grade: could not apply the exercise's blocks: {type(e).__name__}: {e}\n")
    try:
        log_fd = os.dup(2)   # stays open in forked ranks, which point their own fd 2 at files
        log_id = (os.fstat(log_fd).st_dev, os.fstat(log_fd).st_ino)
    except OSError:
        log_fd, log_id = -1, None
    real_root = os.path.realpath(root)
    # /dev/null, /dev/shm semaphores, our own fds, and the grader's test pipes (a folder only the grader adds to)
    exchange = os.environ.get("ZEROEDU_GRADE_EXCHANGE", "")
    allowed = ("/dev/", "/proc/self/") + ((os.path.realpath(exchange) + os.sep,) if exchange else ())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT

    def absolute(path, dir_fd=None):
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

    def outside(path, dir_fd=None, follow=False):
        if isinstance(path, int) or path is None:
            return None
        try:
            full = absolute(path, dir_fd)
            if follow:
                full = os.path.realpath(full)  # writing through a link writes its target
        except (TypeError, ValueError, OSError):
            return None
        if full == real_root or full.startswith(real_root + os.sep) or full.startswith(allowed):
            return None
        return full

    def refuse(what, path):
        # To the grader's pipe: our copy of it, or, if learner code closed that copy, fd 2 while it is still the
        # same pipe (never into a file learner code opened under the same number).
        line = (MARK + json.dumps({"op": what, "path": path, "pid": os.getpid()}) + "\n").encode()
        for fd in (log_fd, 2):
            try:
                if fd >= 0 and (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == log_id:
                    os.write(fd, line)
                    break
            except OSError:
                continue
        raise PermissionError(f"zeroedu grader: refused to {what} {path}: it is outside this notebook's working "
                              f"directory {root}. Graded code may only change files under its own folder.")

    def hook(event, args):
        if event in ("os.remove", "os.rmdir", "shutil.rmtree"):
            full = outside(args[0], args[1] if len(args) > 1 else None)
            if full:
                refuse("delete", full)
        elif event == "os.rename":  # os.rename and os.replace: the source goes away, the target is overwritten
            src, dst = args[0], args[1]
            for path, fd, what in ((src, args[2] if len(args) > 2 else None, "move away"),
                                   (dst, args[3] if len(args) > 3 else None, "replace")):
                full = outside(path, fd)
                if full and (what == "move away" or os.path.lexists(full)):
                    refuse(what, full)
        elif event == "os.truncate":
            full = outside(args[0], follow=True)
            if full:
                refuse("truncate", full)
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & write_flags)
            if writes:
                full = outside(path, follow=True)
                if full and os.path.lexists(full):
                    refuse("write to", full)

    sys.addaudithook(hook)


_install()
del _install
