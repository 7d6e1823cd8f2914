"""Moving bytes between tiers, each move a ledger entry: copies between device and host (op "d2h", "h2d") and
reads and writes of swap files (op "nvme2h", "h2nvme"), all with kind "offload".

TransferMixin holds them for OffloadMixin: `transfer` (a copy, on a CUDA side stream where there is a GPU),
`sync_transfers`, `_file_io` and `_wait_io` (the NVMe writes queued on the worker's io lane), and `_folder`,
which opens the swap folder of an nvme_path. LINKS and transfer_seconds turn a step's bytes into time.

The seam: the CUDA side stream is the one asynchronous mechanism in the training path that is not the worker
(zeroedu/comm/worker.py), and everything about it is in this file (`start_side_stream`, `transfer`,
`sync_transfers`; tests/test_worker.py checks that no other file makes a CUDA stream or event). It stays a
second mechanism on purpose:
- A CUDA copy is asynchronous because of the stream it is queued on, not because of a thread. Put on a lane,
  `copy_(non_blocking=True)` returns at once and the lane's Handle would say "done" before a byte has moved; the
  copy is over only when its CUDA event is, which Event.synchronize() or a stream's wait_stream observe.
- The copies are issued while the host optimizer steps the next sub-groups (write_back) and must be complete
  before the stage's all-gather reads the pieces, in publish: `sync_transfers` waits there and makes the compute
  stream wait for the side stream. Engine.wait() drains in_flight only at the end of the step, after publish, so
  a Handle in in_flight would not remove that wait; the explicit one at publish would stay either way.
- A lane that did the copy blocking would overlap nothing on a GPU: a blocking copy from another host thread
  runs on the legacy default stream, which serializes with the compute kernels.
- `transfer` is also called on the worker's comm lane (a stage-3 gather's job brings its offloaded piece to the
  device), so its copies would join Engine.in_flight from another thread than the one that drains it.
Each of these is a GPU behaviour that no CPU run exercises (on a CPU `_stream` is None and every copy is a
synchronous memcpy), so changing them without a GPU to test on would be changing them blind. What unifying would
take, on a GPU: a Handle whose `work` is the copy's end event (Handle already finishes native collectives that
way), added to in_flight under a lock, and `sync_transfers` replaced by stream waits in the stage's gather.
"""

from __future__ import annotations

import threading
import time

import torch

from zeroedu.comm import LedgerEntry
from zeroedu.engine.extras.offload.swap import SwapFile, SwapFolder
from zeroedu.theory import links

# Peak bandwidth per direction, bytes/s, for the "a step's transfer bytes -> time" arithmetic: host links (PCIe
# x16) and drives (NVMe SSDs). The figures and their sources are in zeroedu.links, shared with zeroedu.planner.
LINKS = {
    "PCIe 3.0 x16": links.PCIE3_X16,
    "PCIe 4.0 x16": links.PCIE4_X16,
    "PCIe 5.0 x16": links.PCIE5_X16,
    "NVMe SSD, PCIe 4.0 x4 (read)": links.NVME_PCIE4_READ,
    "NVMe SSD, PCIe 4.0 x4 (write)": links.NVME_PCIE4_WRITE,
    "NVMe SSD, PCIe 5.0 x4 (read)": links.NVME_PCIE5_READ,
}


def transfer_seconds(nbytes: int, link: str) -> float:
    """Time to move nbytes at a link's peak bandwidth (LINKS): a lower bound, no latency or contention."""
    return nbytes / LINKS[link]


class TransferMixin:
    """Copies and file I/O for OffloadMixin, each one a ledger entry; the state they use is made in its setup."""

    # -- the swap folder of an nvme_path ----------------------------------------------------------------------------
    def _folder(self, oc, key: str, need: int) -> SwapFolder:
        """The swap folder of oc.nvme_path (made on first use; its reads and writes run on the worker's io lane)."""
        if oc.nvme_path not in self._folders:
            self._folders[oc.nvme_path] = SwapFolder(oc.nvme_path, key, self.rank, need)
            self.nvme_removed += self._folders[oc.nvme_path].removed
        return self._folders[oc.nvme_path]

    # -- the CUDA side stream (the seam above) -------------------------------------------------------------------
    def start_side_stream(self) -> None:
        """The side stream the device<->host copies run on (None on a CPU, where they are memcpys), and the copies
        in flight on it; called once from OffloadMixin.setup."""
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._copies: list[tuple] = []   # CUDA copies in flight: (ledger entry, start event, end event, src, dst)
        self._lock = threading.Lock()    # transfer runs on the main thread and on the worker's comm lane

    # -- copies and files, each one a ledger entry ---------------------------------------------------------------
    def _record(self, op: str, t: torch.Tensor, nbytes: int, wall0: float, seconds: float, impl: str,
                phase: str | None = None, step: int | None = None) -> LedgerEntry:
        return self.comm.ledger.note(op, phase or self.comm.phase, "offload",
                                     self.global_step if step is None else step, t, group=(self.global_rank,),
                                     sent_bytes=nbytes, impl=impl, seconds=seconds, start=wall0)

    def transfer(self, dst: torch.Tensor, src: torch.Tensor, op: str, phase: str | None = None,
                 step: int | None = None, sync: bool = False) -> None:
        """dst.copy_(src) between device and host, recorded. CUDA: on the side stream, returns before it is done
        unless sync (call sync_transfers before reading dst). CPU: the device is the host, a memcpy."""
        nbytes = src.numel() * src.element_size()
        wall0, t0 = time.time(), time.perf_counter()
        if self._stream is None:
            dst.copy_(src)
            self._record(op, src, nbytes, wall0, time.perf_counter() - t0, "memcpy", phase, step)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))   # src is ready on the compute stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        entry = self._record(op, src, nbytes, wall0, 0.0, "cuda_side_stream", phase, step)
        with self._lock:
            self._copies.append((entry, start, end, src, dst))   # keeps both alive until the copy is done
        if sync:
            end.synchronize()

    def sync_transfers(self) -> None:
        if self._stream is None:
            return
        self._stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        with self._lock:
            for entry, start, end, *_ in self._copies:
                entry.seconds = start.elapsed_time(end) / 1e3
            self._copies.clear()

    def _file_io(self, op: str, f: SwapFile, offset: int, t: torch.Tensor, phase: str | None = None,
                 step: int | None = None) -> None:
        wall0, t0 = time.time(), time.perf_counter()
        nbytes = f.write(offset, t) if op == "h2nvme" else f.read(offset, t)
        self._record(op, t, nbytes, wall0, time.perf_counter() - t0, "file", phase, step)

    def _wait_io(self) -> None:
        pending, self._io_pending = self._io_pending, []
        for handle in pending:
            handle.wait()
