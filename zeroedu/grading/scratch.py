"""The grader's scratch folders, removed whatever a learner left in them.

shutil.rmtree recurses once per folder level (CPython 3.10 to 3.12; 3.13's walks with a stack), so a learner's 1,100
RecursionError there; it also stops at a folder the learner made unreadable. remove_tree walks with its own
stack, opens every folder relative to its parent's descriptor without following links (a link to a host folder
is removed, never entered), and gives itself the permissions it needs on the way down. It never raises: what it
could not remove is returned as a sentence for the gradebook's notes.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_dir(name: str, parent: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:   # a folder the learner made 0 (no obstacle to root, but to a normal user)
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=parent)
        try:
            if not stat.S_ISDIR(os.fstat(handle).st_mode):   # swapped for a link meanwhile: never chmod its target
                raise
            os.chmod(f"/proc/self/fd/{handle}", 0o700)
        finally:
            os.close(handle)
        return os.open(name, _DIR_FLAGS, dir_fd=parent)


def remove_tree(path: Path) -> str:
    """Remove `path` and everything under it; '' when done, else why not (it never raises)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        return f"could not remove {path}: {e.strerror or e}"
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return ""
        _remove_contents(str(path))
        os.rmdir(path)
        return ""
    except OSError as e:
        return f"could not remove all of {path}: {e.strerror or e}"


def _remove_contents(top: str) -> None:
    """Empty the folder `top`: depth first with an explicit stack of (descriptor, name in parent) pairs."""
    stack: list[tuple[int, str]] = [(_open_dir(top, None), "")]
    try:
        while stack:
            fd, _ = stack[-1]
            child = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                stack.append((_open_dir(child, fd), child))
                continue
            fd, name = stack.pop()
            os.close(fd)
            if stack:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(name, dir_fd=stack[-1][0])
    finally:
        for fd, _ in stack:
            with contextlib.suppress(OSError):
                os.close(fd)
