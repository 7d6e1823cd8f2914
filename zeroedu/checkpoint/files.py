"""Writing a checkpoint's files so that a crash never leaves a half-written checkpoint where a complete one is
looked for: each file flushed to disk (fsync), `latest` replaced atomically, and a finished save renamed into
place (`commit_folder`). A full disk or file-size limit is said in bytes, instead of torch's "unexpected pos".
"""

from __future__ import annotations

import errno
import os
import shutil

from zeroedu.checkpoint.fileformat import CheckpointError


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class _Counter:
    """A file-like sink that only counts what is written to it: the size a torch.save would have on disk."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _device(path: str) -> str:
    """The file system that holds `path`: its device (or tmpfs, ...) and mount point, as /proc/self/mounts says."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        with open("/proc/self/mounts") as f:
            devices = [line.split()[0] for line in f if line.split()[1:2] == [mount]]
    except OSError:
        devices = []
    return f"{devices[-1]} (mounted on {mount})" if devices else mount


def _errno_of(e: BaseException) -> int | None:
    """The errno behind an exception, looking through its causes: torch.save reports a failed write as
    RuntimeError("... unexpected pos ...") with the OSError only in __context__."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def write_checked(path: str, write) -> None:
    """_write, and when the disk (or the file-size limit) is full: remove the piece written and say how many
    bytes the file needs and how many there are, instead of torch's "unexpected pos"."""
    try:
        _write(path, write)
    except Exception as e:
        code = _errno_of(e)
        if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        try:
            os.remove(path)
        except OSError:
            pass
        need = _Counter()
        write(need)
        folder = os.path.dirname(os.path.abspath(path))
        if code == errno.EFBIG:
            import resource  # POSIX only, as file-size limits are

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            raise CheckpointError(f"file too large: {path} needs {need.bytes:,} bytes, but this process may write "
                                  f"files of at most {limit:,} bytes (RLIMIT_FSIZE, `ulimit -f`). Raise the limit, "
                                  "or shard the state over more ranks.") from e
        free = shutil.disk_usage(folder).free
        quota = " (or the disk quota is used up)" if code == errno.EDQUOT else ""
        raise CheckpointError(f"no space left on {_device(folder)}{quota}: {os.path.basename(path)} needs "
                              f"{need.bytes:,} bytes, {free:,} bytes are free. Free some space or save to "
                              "another folder.") from e


def write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    write_checked(tmp, write)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def commit_folder(partial: str, final: str) -> None:
    """Move the complete `partial` directory to `final`; at every instant a complete checkpoint is findable."""
    previous = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.previous")
    if os.path.exists(final) and os.path.exists(previous):
        shutil.rmtree(previous)           # left by a crash after an earlier commit: final is the live one
    if os.path.exists(final):
        os.rename(final, previous)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(previous, ignore_errors=True)
