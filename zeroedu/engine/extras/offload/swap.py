"""The NVMe tier's files: each process's private swap folder under nvme_path and the flat swap files in it.

SwapFolder makes the folder (after removing the folders of dead processes, remove_stale) and deletes it at
close() or interpreter exit; SwapFile reads and writes one flat array a piece at a time. Setting them up raises
OffloadError, before training starts, when nvme_path is missing, unwritable or full (check_nvme_path, and the
space each swap file reserves).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import tempfile
import weakref

import torch

PREFIX = "zeroedu-offload-"
MARKER = "owner.pid"
"""Each process's swap folder is `nvme_path/zeroedu-offload-rank<r>-pid<p>-XXXX`, with a marker file holding
"<pid> <hostname>". A later run removes the folders whose process is gone from this host."""


class OffloadError(RuntimeError):
    """The offload tier cannot be set up (nvme_path missing, unwritable or full); raised before training starts."""


# -- the NVMe folder ---------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    return True


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def remove_stale(nvme_path: str) -> list[str]:
    """Delete swap folders under nvme_path whose process died (killed mid-step, os._exit); say what went.

    A folder is stale when its marker names this host and a pid that no longer runs. Folders without a marker
    (still being created) and folders of live processes or of other hosts are left alone. A folder is renamed
    before it is deleted, so two ranks cleaning the same nvme_path never both claim it.
    """
    removed = []
    try:
        names = sorted(os.listdir(nvme_path))
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(nvme_path, name)
        if not name.startswith(PREFIX) or name.endswith(".removing"):
            continue
        try:
            with open(os.path.join(folder, MARKER)) as f:
                pid_text, host = f.read().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if host != socket.gethostname() or _pid_alive(pid):
            continue
        size = _folder_bytes(folder)
        grave = folder + ".removing"
        try:
            os.rename(folder, grave)
        except OSError:
            continue   # another rank claimed it first
        shutil.rmtree(grave, ignore_errors=True)
        removed.append(f"{folder} (left by pid {pid}, which is no longer running; {size} bytes)")
    return removed


def check_nvme_path(nvme_path: str, need_bytes: int, key: str = "nvme_path") -> None:
    """Raise OffloadError, naming the problem and the fix, unless nvme_path is a folder with need_bytes free."""
    if not os.path.exists(nvme_path):
        raise OffloadError(f"{key} = {nvme_path!r} does not exist. Create it (mkdir -p {nvme_path}) or point "
                           f"{key} at a folder on a fast local disk (an NVMe SSD).")
    if not os.path.isdir(nvme_path):
        raise OffloadError(f"{key} = {nvme_path!r} is a file, not a folder. Point {key} at a folder; zeroedu "
                           "creates its swap files in a private subfolder there.")
    free = shutil.disk_usage(nvme_path).free
    if free < need_bytes:
        raise OffloadError(f"{key} = {nvme_path!r} has {free:,} bytes free, and this rank's swap files need "
                           f"{need_bytes:,}. Free space there, point {key} at a bigger disk, or offload to 'cpu'.")


class SwapFile:
    """One flat array on disk (this rank's shard of one kind of state), read and written a piece at a time."""

    def __init__(self, path: str, numel: int, dtype: torch.dtype, key: str) -> None:
        self.path, self.numel, self.dtype = path, numel, dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._closer = weakref.finalize(self, os.close, self.fd)
        nbytes = numel * self.itemsize
        try:   # reserve the blocks now: a full disk fails here, before training, not in the middle of a step
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, 0, max(nbytes, 1))
            else:
                os.ftruncate(self.fd, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OffloadError(f"{key}: not enough space for {path} ({nbytes:,} bytes): {e.strerror}. Free "
                                   f"space there, point {key} at a bigger disk, or offload to 'cpu'.") from None
            raise

    @staticmethod
    def _bytes(t: torch.Tensor) -> memoryview:
        return memoryview(t.detach().view(torch.uint8).numpy())   # the tensor's own memory, no copy

    def write(self, offset: int, src: torch.Tensor) -> int:
        """Write src (contiguous, CPU) at element `offset`; returns the bytes written."""
        buf = self._bytes(src.contiguous())
        pos, done = offset * self.itemsize, 0
        while done < len(buf):
            done += os.pwrite(self.fd, buf[done:], pos + done)
        return done

    def read(self, offset: int, out: torch.Tensor) -> int:
        """Fill `out` (contiguous, CPU) from element `offset`; returns the bytes read."""
        buf = self._bytes(out)
        pos, done = offset * self.itemsize, 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], pos + done)
            if n == 0:
                raise OffloadError(f"{self.path} ended early at byte {pos + done}: was it truncated or removed?")
            done += n
        return done

    def close(self) -> None:
        self._closer()


class SwapFolder:
    """This process's private folder under nvme_path; deleted by close() or, failing that, at interpreter exit."""

    def __init__(self, nvme_path: str, key: str, rank: int, need_bytes: int) -> None:
        check_nvme_path(nvme_path, 0, key)
        self.key = key
        self.removed = remove_stale(nvme_path)   # first, so that their space counts as free below
        for line in self.removed:
            print(f"zeroedu offload: removed stale swap folder {line}", file=sys.stderr, flush=True)
        try:
            self.path = tempfile.mkdtemp(prefix=f"{PREFIX}rank{rank}-pid{os.getpid()}-", dir=nvme_path)
            with open(os.path.join(self.path, MARKER), "w") as f:
                f.write(f"{os.getpid()} {socket.gethostname()}\n")
        except OSError as e:
            raise OffloadError(f"{key} = {nvme_path!r} is not writable ({e.strerror}). Give this user write "
                               f"permission there, or point {key} at a folder it can write.") from None
        self._remover = weakref.finalize(self, shutil.rmtree, self.path, True)   # atexit=True by default
        self.files: dict[str, SwapFile] = {}
        try:
            check_nvme_path(nvme_path, need_bytes, key)
        except OffloadError:
            self.close()
            raise

    def file(self, name: str, numel: int, dtype: torch.dtype) -> SwapFile:
        if name not in self.files:
            self.files[name] = SwapFile(os.path.join(self.path, name + ".bin"), numel, dtype, self.key)
        return self.files[name]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self._remover()

