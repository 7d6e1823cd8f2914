"""Offload: the optimizer's shard on the host (ZeRO-Offload) or on NVMe (ZeRO-Infinity), parameters too at stage 3.

ZeRO stages 1-3 cut the model states into N shards. Offload moves a rank's shard to a bigger, slower tier than
the accelerator. `offload_optimizer` (stages 1-3) moves what only the optimizer step needs; `offload_param`
(stage 3) moves the compute-dtype parameter shard as well. Where the bytes of one rank live, and when they move:

    device  compute parameters (all of them at stages 1-2, this rank's 1/N at stage 3 unless offload_param),
            activations, gradients while backward makes them, bucket buffers
    host    fp32 master weights and optimizer state (cpu), the reduced gradient shard (cpu and nvme),
            `buffer_count` sub-group buffers (nvme), the parameter shard (offload_param cpu) or
            offload_param's `buffer_count` piece buffers (offload_param nvme)
    nvme    fp32 master weights and optimizer state (offload_optimizer nvme), the parameter shard
            (offload_param nvme): files in a private folder under nvme_path

    backward  each bucket is reduce-scattered on the device into a small staging piece, which is copied to
              the host shard right away on the comm thread (d2h), while backward goes on
    step      the optimizer runs on the CPU. nvme: one sub-group (one bucket's piece) at a time: read it
              (nvme2h), step it, write it back (h2nvme), with up to buffer_count - 1 reads ahead of the step
              and the writes behind it. The updated piece goes back to the device in the compute dtype (h2d:
              2 bytes/parameter in bf16, the cast happens on the host), then the stage all-gathers as usual
    forward   (offload_param) a unit's piece is brought to the device just before its all-gather, inside the
              gather's job on the comm thread (Stage3.param_piece), so the stage's prefetch brings it early. At
              nvme it is read into one of offload_param's `buffer_count` host buffers first; the step's updated
              pieces go back to their file through the same buffers, so host memory for parameters stays
              buffer_count x the largest piece

Every copy between tiers is a ledger entry (op "d2h", "h2d", "h2nvme", "nvme2h", kind "offload") with the bytes
it moved and when. On CUDA the copies run on a side stream with non_blocking=True, from and to pinned host
buffers where pin_memory is set (that path is written for GPUs but has not run on one yet). On a machine without
a GPU the device *is* the CPU: "host" and "device" tensors are separate tensors in the same RAM, the copies are
memcpys, and the tiers are accounting categories. The NVMe tier is real files either way.

The sub-group that NVMe reads and writes at once is one bucket's piece (reduce_bucket_size / N elements at
stages 1-2, one module's unit / N at stage 3): DeepSpeed's `sub_group_size`, which zeroedu does not take as a
key. Host bytes for optimizer state are therefore buffer_count x (4 + state bytes) x the largest piece, whatever
the model's size.

DeepSpeed's NVMe swapping of optimizer state lives in its stage-3 optimizer (ZeRO-Infinity); its stage 1-2 optimizer
offloads to the CPU only. zeroedu runs the NVMe tier at stages 1-3, so a config meant for DeepSpeed should pair
"nvme" with stage 3.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from zeroedu.comm import LedgerEntry
from zeroedu.engine import make_optimizer, trim_timeline
from zeroedu.flat import Bucket
from zeroedu.memory import resident

CPU_ADAM = "fused"
"""Which torch Adam runs the host step: "fused" (one C++ kernel over every piece), "foreach" (vectorized ops over
lists of tensors) or "loop" (one tensor at a time, torch's default on CPU). `cpu_adam_speed()` measures them, the
implementations taking turns step by step, best of 5 steps, on this 2-core machine under a load average of 11-19:
4M fp32 parameters in 8 tensors, 1 thread (as each of 2 launched ranks runs): fused 3.4 ms, loop 39 ms, foreach
46 ms; 2 threads, over several runs: fused 15-59 ms, foreach 86-274 ms, loop 198-564 ms; 16M in 16 tensors: fused
77-299 ms, foreach 913-1399 ms, loop 1494-1744 ms. Fused was the fastest in every run but one disturbed sample.
It differs from the loop by about one float32 rounding (2e-7); foreach and loop agree bit for bit. Set it before
`initialize`."""

PREFIX = "zeroedu-offload-"
MARKER = "owner.pid"
"""Each process's swap folder is `nvme_path/zeroedu-offload-rank<r>-pid<p>-XXXX`, with a marker file holding
"<pid> <hostname>". A later run removes the folders whose process is gone from this host."""

# Peak bandwidth per direction, bytes/s, for the "a step's transfer bytes -> time" arithmetic. PCIe x16 after
# line coding (8, 16, 32 GT/s per lane, 128b/130b); SSDs: typical sequential figures of current drives.
LINKS = {
    "PCIe 3.0 x16": 15.75e9,
    "PCIe 4.0 x16": 31.5e9,
    "PCIe 5.0 x16": 63.0e9,
    "NVMe SSD, PCIe 4.0 x4 (read)": 7.0e9,
    "NVMe SSD, PCIe 4.0 x4 (write)": 6.0e9,
    "NVMe SSD, PCIe 5.0 x4 (read)": 14.0e9,
}


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


def _state_bytes_per_element(cfg) -> int:
    """fp32 bytes of elementwise optimizer state per parameter (for the disk-space check before training)."""
    kind, kw = cfg.optimizer.type, cfg.optimizer.params
    if kind in ("Adam", "AdamW"):
        return 12 if kw.get("amsgrad") else 8
    return 4 if kw.get("momentum", 0) else 0


def host_optimizer(cfg, params: list[torch.nn.Parameter], impl: str | None = None) -> torch.optim.Optimizer:
    """The configured optimizer, in the CPU implementation `impl` (default CPU_ADAM) for Adam and AdamW."""
    impl = impl or CPU_ADAM
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    if impl not in flags:
        raise ValueError(f"zeroedu.offload.CPU_ADAM must be 'fused', 'foreach' or 'loop', got {impl!r}")
    if cfg.optimizer.type not in ("Adam", "AdamW"):
        return make_optimizer(cfg, params)
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[cfg.optimizer.type]
    return cls(params, **dict(cfg.optimizer.params), **flags[impl])


# -- the engine ----------------------------------------------------------------------------------------------------

class OffloadMixin:
    """offload_optimizer (stages 1-3) and offload_param (stage 3), layered on a stage by compose.engine_class."""

    keeps_parameter_copies = True   # the fp32 master (and offload_param's pieces) live on the host or NVMe

    def build_optimizer(self) -> torch.optim.Optimizer:
        if self.opt_tier != "none":   # the step runs on the host: the fastest CPU implementation
            return host_optimizer(self.config, self.master_pieces)
        return super().build_optimizer()

    # -- setup: move the shard to its tiers --------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        zc = self.config.zero_optimization
        self.opt_tier, self.param_tier = zc.offload_optimizer.device, zc.offload_param.device
        self.global_rank = dist.get_rank()
        self.adam_timeline: list[tuple[str, float, float]] = []   # (what, start, end) of host optimizer work
        self.nvme_removed: list[str] = []                          # stale swap folders this run deleted
        self.written_back = False        # has this step's update already reached the compute parameters?
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._copies: list[tuple] = []   # CUDA copies in flight: (ledger entry, start event, end event, src, dst)
        self._lock = threading.Lock()
        self._folders: dict[str, SwapFolder] = {}
        self._io: ThreadPoolExecutor | None = None
        self._io_pending: list[Future] = []
        self._staging: dict[int, torch.Tensor] = {}   # bucket -> the device piece its reduction lands in
        self._param_pool: queue.SimpleQueue[torch.Tensor] | None = None   # offload_param nvme: host buffers
        self._pin_opt = zc.offload_optimizer.pin_memory and self.device.type == "cuda"
        self._pin_param = zc.offload_param.pin_memory and self.device.type == "cuda"
        self.max_piece = max(b.piece for b in self.layout.buckets)
        with self.comm.in_phase("init"):
            if self.opt_tier != "none":
                self._offload_optimizer(zc.offload_optimizer)
            if self.param_tier != "none":
                self._offload_parameters(zc.offload_param)

    def _folder(self, oc, key: str, need: int) -> SwapFolder:
        if oc.nvme_path not in self._folders:
            self._folders[oc.nvme_path] = SwapFolder(oc.nvme_path, key, self.rank, need)
            self.nvme_removed += self._folders[oc.nvme_path].removed
            self._io = self._io or ThreadPoolExecutor(1, thread_name_prefix="zeroedu-nvme")   # FIFO: one worker
        return self._folders[oc.nvme_path]

    def _offload_optimizer(self, oc) -> None:
        n = self.layout.shard_numel
        buckets = self.layout.buckets
        device_masters = [p.data for p in self.master_pieces]
        if oc.device == "cpu":
            self.host_master = torch.empty(n, dtype=torch.float32, pin_memory=self._pin_opt)
            for b, m in zip(buckets, device_masters, strict=True):
                self.transfer(self.layout.piece_of_shard(self.host_master, b), m, "d2h", sync=True)
            pieces = [self.layout.piece_of_shard(self.host_master, b) for b in buckets]
        else:
            self.host_master = None
            key = "zero_optimization.offload_optimizer.nvme_path"
            folder = self._folder(oc, key, n * (4 + _state_bytes_per_element(self.config)))
            self.master_file = folder.file("master_weights", n, torch.float32)
            self.state_files: dict[str, SwapFile] = {}
            for b, m in zip(buckets, device_masters, strict=True):
                host = torch.empty(b.piece, dtype=torch.float32)
                self.transfer(host, m, "d2h", sync=True)   # CUDA: done before the file write reads it
                self._file_io("h2nvme", self.master_file, b.shard_start, host)
            # Expected state files are created (and their space reserved) now; others appear on first use.
            per = _state_bytes_per_element(self.config) // 4
            names = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] if self.config.optimizer.type != "SGD" else [
                "momentum_buffer"]
            for name in names[:per]:
                self.state_files[name] = folder.file(f"optimizer_state.{name}", n, torch.float32)
            self.buffer_count = oc.buffer_count
            # Sub-group buffers: buffer_count x {master, each state tensor} x the largest piece; state buffers
            # are made when the optimizer first shows its state keys.
            self.slots: list[dict[str, torch.Tensor]] = [
                {"master": torch.empty(self.max_piece, dtype=torch.float32)} for _ in range(oc.buffer_count)]
            pieces = [torch.empty(0) for _ in buckets]
        self.master_pieces = [torch.nn.Parameter(t) for t in pieces]
        self.master_shard = self.host_master
        # The reduced gradient shard lives on the host; the stage's device shard (stages 2-3) goes away.
        self.host_grads = torch.zeros(n, dtype=self.dtype, pin_memory=self._pin_opt)
        self._grad_tmp = None        # stages 2-3: where a reduced piece lands before it is added to the shard
        if self.partitions_grads:
            self._grad_tmp = torch.empty(self.max_piece, dtype=self.dtype, pin_memory=self._pin_opt)
            self.grad_shard = self.host_grads

    def _offload_parameters(self, oc) -> None:
        n = self.layout.shard_numel
        device_shard = self.param_shard
        if oc.device == "cpu":
            self.param_host, self.param_file = torch.empty(n, dtype=self.dtype, pin_memory=self._pin_param), None
            self.transfer(self.param_host, device_shard, "d2h", sync=True)
        else:
            self.param_host = None
            itemsize = device_shard.element_size()
            folder = self._folder(oc, "zero_optimization.offload_param.nvme_path", n * itemsize)
            self.param_file = folder.file("parameters", n, self.dtype)
            # buffer_count host buffers of the largest piece: every read and write of the file goes through them
            self._param_buffers = [torch.empty(self.max_piece, dtype=self.dtype, pin_memory=self._pin_param)
                                   for _ in range(oc.buffer_count)]
            self._param_pool = queue.SimpleQueue()
            for buf in self._param_buffers:
                self._param_pool.put(buf)
            for b in self.layout.buckets:
                buf = self._param_pool.get()
                host = buf[: b.piece]
                self.transfer(host, self.layout.piece_of_shard(device_shard, b), "d2h", sync=True)
                self._file_io("h2nvme", self.param_file, b.shard_start, host)
                self._param_pool.put(buf)
        # The device keeps no parameter shard, only the units it gathers (and the persistent ones). In fp32
        # without optimizer offload the master pieces still hold the old shard's memory: it is the master.
        self.param_shard = torch.empty(0, dtype=self.dtype, device=self.device)

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
        for fut in pending:
            fut.result()

    # -- backward: gradients stream to the host as their buckets are reduced ----------------------------------------
    def before_backward(self) -> None:
        super().before_backward()
        if self.opt_tier != "none" and not self.partitions_grads and self.grad_shard is not None:
            self.grad_shard = self.host_grads   # stage 1 makes a fresh shard at the boundary; ours persists

    def grad_out(self, b: Bucket) -> torch.Tensor:
        """The stage reduces bucket b into a small piece on the device; the piece then goes to the host shard."""
        if self.opt_tier == "none":
            return super().grad_out(b)
        self._staging[b.index] = torch.zeros(b.piece, dtype=self.dtype, device=self.device)
        return self._staging[b.index]

    def reduce_bucket(self, b: Bucket) -> None:
        super().reduce_bucket(b)          # queues the reduce-scatter (stages 2-3: and the add) into grad_out(b)
        self._send_staged()

    def after_backward(self) -> None:
        super().after_backward()
        self._send_staged()

    def _send_staged(self) -> None:
        """Queue the copy to the host of every piece whose reduction was queued, behind it on the comm thread."""
        staged, self._staging = self._staging, {}
        phase, step = self.comm.phase, self.global_step
        for i, staging in staged.items():
            b = self.layout.buckets[i]
            self.overlap(lambda b=b, staging=staging: self.grad_to_host(b, staging, phase, step))

    def grad_to_host(self, b: Bucket, staging: torch.Tensor, phase: str, step: int) -> None:
        """Bucket b's reduced piece (`staging`, on the device) into the host gradient shard; on the comm thread,
        behind the reduction, with the phase and step it was queued in."""
        out = self.layout.piece_of_shard(self.host_grads, b)
        if not self.partitions_grads:   # stage 1 reduces once per step: the copy is the gradient
            self.transfer(out, staging, "d2h", phase, step, sync=True)
            return
        tmp = self._grad_tmp[: b.piece]   # stages 2-3 reduce every micro-step: accumulate on the host
        self.transfer(tmp, staging, "d2h", phase, step, sync=True)
        out.add_(tmp)

    # -- the step, on the host ------------------------------------------------------------------------------------
    def optimizer_step(self, grads: list[torch.Tensor], coef: float) -> None:
        if self.opt_tier == "none":   # offload_param only: the optimizer stays on the device
            super().optimizer_step(grads, coef)
            return
        if self.opt_tier == "cpu":
            self.host_step(grads, coef)
            for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
                self.write_back(b, master.detach())
        else:
            self._nvme_step(grads, coef)   # sub-group by sub-group, each written back as soon as it is stepped
        self.written_back = True

    def host_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """offload_optimizer cpu: one optimizer step of every host master piece with grads x coef."""
        t0 = time.time()
        for master, g in zip(self.master_pieces, grads, strict=True):
            master.grad = self._scaled(g, coef)
        self.optimizer.step()
        for master in self.master_pieces:
            master.grad = None
        self.adam_timeline.append(("adam", t0, time.time()))
        trim_timeline(self.adam_timeline)

    @staticmethod
    def _scaled(g: torch.Tensor, coef: float) -> torch.Tensor:
        return g if (g.dtype == torch.float32 and coef == 1.0) else g.float().mul_(coef)   # as Engine does

    def _nvme_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """Sub-group by sub-group: read (nvme2h), step, write back (h2nvme), buffer_count sub-groups in host memory.

        One I/O thread runs reads and writes in the order they are submitted. Sub-group i uses buffer i mod k;
        the read of sub-group i + k - 1 is submitted before sub-group i steps, after the write of the previous
        user of its buffer (sub-group i - 1), so it overlaps the step and never overwrites unsaved data.
        """
        k, ahead = self.buffer_count, self.buffer_count - 1
        buckets, pieces = self.layout.buckets, self.master_pieces
        reads: dict[int, Future] = {}
        writes: list[Future] = []

        def read(i: int) -> None:
            reads[i] = self._io.submit(self._swap_in, i, self.slots[i % k], self.global_step)

        for i in range(min(ahead, len(pieces))):
            read(i)
        for i, (b, master, g) in enumerate(zip(buckets, pieces, grads, strict=True)):
            if i + ahead < len(pieces) and ahead > 0:
                read(i + ahead)
            if i not in reads:
                read(i)
            reads.pop(i).result()
            t0 = time.time()
            master.grad = self._scaled(g, coef)
            self.optimizer.step()    # only this piece has a gradient: Adam skips the others
            master.grad = None
            self.adam_timeline.append(("adam", t0, time.time()))
            trim_timeline(self.adam_timeline)
            self.write_back(b, master.detach())   # copied or cast out of the buffer before its next read
            writes.append(self._io.submit(self._swap_out, i, self.global_step))
        for w in writes:
            w.result()

    def _swap_in(self, i: int, slot: dict[str, torch.Tensor], step: int) -> None:
        b, master = self.layout.buckets[i], self.master_pieces[i]
        view = slot["master"][: b.piece]
        self._file_io("nvme2h", self.master_file, b.shard_start, view, "step", step)
        state = self.optimizer.state[master]
        for name, f in self.state_files.items():
            if name in state:   # stepped before (else the optimizer creates its state in this step)
                if name not in slot:
                    slot[name] = torch.empty(self.max_piece, dtype=torch.float32)
                state[name] = slot[name][: b.piece]
                self._file_io("nvme2h", f, b.shard_start, state[name], "step", step)
        master.data = view

    def _swap_out(self, i: int, step: int) -> None:
        b, master = self.layout.buckets[i], self.master_pieces[i]
        self._file_io("h2nvme", self.master_file, b.shard_start, master.data, "step", step)
        state = self.optimizer.state[master]
        for name, v in list(state.items()):
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == b.piece:
                if name not in self.state_files:   # a state tensor this optimizer showed only now
                    folder = self._folders[self.config.zero_optimization.offload_optimizer.nvme_path]
                    self.state_files[name] = folder.file(f"optimizer_state.{name}", self.layout.shard_numel,
                                                         torch.float32)
                self._file_io("h2nvme", self.state_files[name], b.shard_start, v, "step", step)
                state[name] = torch.empty(0)   # a placeholder until the next read
        master.data = torch.empty(0)

    def _master_value(self, i: int) -> torch.Tensor:
        """The fp32 master piece i, wherever it lives (read from its file at nvme)."""
        if self.opt_tier != "nvme":
            return self.master_pieces[i].detach()
        b = self.layout.buckets[i]
        out = torch.empty(b.piece, dtype=torch.float32)
        self.master_file.read(b.shard_start, out)
        return out

    def write_back(self, b: Bucket, master: torch.Tensor) -> None:
        """The updated fp32 master piece to the compute parameters' home (param_home, or its host or NVMe copy
        with offload_param), in the compute dtype. Nothing to do once this step's update is there
        (`written_back`): the stage's publish calls it again for every piece.

        The cast happens where the master is, so bf16 halves the bytes on the bus. `master` may be an NVMe
        sub-group buffer that the next read overwrites: everything here copies out of it before returning
        (a CUDA copy from it is made from a fresh cast or copy, which the copy keeps alive).
        """
        if self.written_back:
            return
        on_device = self.opt_tier == "none"   # offload_param alone: the step ran on the device
        if self.param_tier == "none":
            if self._stream is None:   # a synchronous memcpy reads the master (or its cast) right away
                value = master.to(self.dtype)
            else:                      # an asynchronous copy needs a source of its own, pinned to be asynchronous
                value = torch.empty(b.piece, dtype=self.dtype, pin_memory=self._pin_opt).copy_(master)
            self.transfer(self.param_home(b), value, "h2d")
        elif self.param_tier == "cpu":
            dst = self.layout.piece_of_shard(self.param_host, b)
            if on_device:
                self.transfer(dst, master.to(self.dtype), "d2h", sync=True)
            else:
                dst.copy_(master)    # host to host: no bus crossed
        else:
            buf = self._param_pool.get()   # waits while every buffer has a write in flight
            host = buf[: b.piece]
            if on_device:
                self.transfer(host, master.to(self.dtype), "d2h", sync=True)
            else:
                host.copy_(master)
            phase, step = self.comm.phase, self.global_step

            def write() -> None:
                try:
                    self._file_io("h2nvme", self.param_file, b.shard_start, host, phase, step)
                finally:
                    self._param_pool.put(buf)

            self._io_pending.append(self._io.submit(write))

    def publish(self) -> None:
        if not self.written_back:   # a checkpoint load, or offload_param alone (the step ran on the device)
            for i, b in enumerate(self.layout.buckets):
                self.write_back(b, self._master_value(i))
            self.written_back = True
        self.sync_transfers()
        self._wait_io()
        try:   # the stage's publish: its write_back finds every piece home, then it gathers through param_piece
            super().publish()
        finally:
            self.written_back = False

    # -- parameter offload (stage 3): to the device just before the gather ------------------------------------------
    def param_piece(self, b: Bucket) -> torch.Tensor:
        """This rank's piece of unit b, brought to the device from its tier. Stage 3 (and ZeRO++) call it inside
        the gather's job on the comm thread, so a prefetched gather brings it early too."""
        if self.param_tier == "none":
            return super().param_piece(b)
        piece = torch.empty(b.piece, dtype=self.dtype, device=self.device)
        if self.param_file is None:
            self.transfer(piece, self.layout.piece_of_shard(self.param_host, b), "h2d", sync=True)
            return piece
        buf = self._param_pool.get()
        try:
            host = buf[: b.piece]
            self._file_io("nvme2h", self.param_file, b.shard_start, host)
            self.transfer(piece, host, "h2d", sync=True)
        finally:
            self._param_pool.put(buf)
        return piece

    # -- memory by tier -------------------------------------------------------------------------------------------
    def _host_owned(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {c: [] for c in ("parameters", "gradients", "master_weights",
                                                                "optimizer_state", "buckets", "other")}
        if self.opt_tier != "none":
            opt = getattr(self, "optimizer", None)
            state = [v for s in (opt.state.values() if opt else []) for v in s.values() if isinstance(v, torch.Tensor)]
            out["gradients"] = [self.host_grads]
            out["buckets"] = [self._grad_tmp] if self._grad_tmp is not None else []
            out["optimizer_state"] = [v for v in state if v.dim() > 0]
            out["other"] = [v for v in state if v.dim() == 0]   # step counters
            if self.opt_tier == "cpu":
                out["master_weights"] = [self.host_master]
            else:
                out["master_weights"] = [s["master"] for s in self.slots]
                out["optimizer_state"] += [t for s in self.slots for k, t in s.items() if k != "master"]
        if self.param_tier == "cpu":
            out["parameters"] = [self.param_host]
        elif self.param_tier == "nvme":   # the buffers every read and write of the parameter file goes through
            out["parameters"] = list(self._param_buffers)
        return out

    def owned(self) -> dict[str, list[torch.Tensor]]:
        """The device tier: what the stage owns minus what moved to the host."""
        base = super().owned()
        away = {t.untyped_storage().data_ptr() for ts in self._host_owned().values() for t in ts
                if t.untyped_storage().nbytes()}
        return {cat: [t for t in ts if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in away]
                for cat, ts in base.items()}

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """{"host": bytes by category of live host tensors, "nvme": bytes by category of swap files on disk}."""
        out = {"host": resident(self._host_owned())}
        if self._folders:
            nvme = {"parameters": 0, "master_weights": 0, "optimizer_state": 0}
            for folder in self._folders.values():
                for name, f in folder.files.items():
                    cat = "optimizer_state" if name.startswith("optimizer_state") else name
                    nvme[cat] += os.stat(f.path).st_size
            out["nvme"] = nvme
        return out

    @property
    def swap_folders(self) -> list[str]:
        return [f.path for f in self._folders.values()]

    # -- full weights and checkpoints (zeroedu.checkpoint calls these hooks) -----------------------------------------
    def master_full(self) -> torch.Tensor:
        if self.opt_tier != "nvme":
            return super().master_full()
        full = torch.zeros(self.layout.full_numel, dtype=torch.float32)
        for i, b in enumerate(self.layout.buckets):
            self.comm.all_gather(self.layout.bucket_view(full, b), self._master_value(i), kind="other")
        return full

    def checkpoint_master(self) -> list[torch.Tensor]:
        return [self._master_value(i) for i in range(len(self.master_pieces))]

    def checkpoint_optimizer_state(self) -> list[dict]:
        states = []
        for b, master in zip(self.layout.buckets, self.master_pieces, strict=True):
            s = dict(self.optimizer.state.get(master, {}))
            if self.opt_tier == "nvme":
                for name, f in self.state_files.items():
                    if name in s:
                        s[name] = torch.empty(b.piece, dtype=torch.float32)
                        f.read(b.shard_start, s[name])
            states.append(s)
        return states

    def restore_checkpoint(self, master: list[torch.Tensor], state: list[dict] | None) -> None:
        for i, (b, piece) in enumerate(zip(self.layout.buckets, self.master_pieces, strict=True)):
            if self.opt_tier == "nvme":
                self.master_file.write(b.shard_start, master[i].float())
            else:
                piece.data.copy_(master[i])
            if state is None:
                continue
            s = dict(state[i])
            if self.opt_tier == "nvme":
                for name, v in list(s.items()):
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == b.piece:
                        if name not in self.state_files:
                            raise OffloadError(f"checkpoint optimizer state {name!r} has no swap file here")
                        self.state_files[name].write(b.shard_start, v.float())
                        s[name] = torch.empty(0)
            self.optimizer.state[piece] = s
        self.written_back = False   # the caller's publish() brings the loaded weights to the parameters

    def close(self) -> None:
        """Finish NVMe I/O and delete this rank's swap folders (interpreter exit does it too, if not done)."""
        self._wait_io()
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        for folder in self._folders.values():
            folder.close()


# -- measurements for the notebook and the course ------------------------------------------------------------------

def cpu_adam_speed(numel: int = 4_000_000, pieces: int = 8, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Time one Adam step over `numel` fp32 parameters (in `pieces` tensors) for each CPU implementation.

    The implementations take turns, step by step, so that a busy machine slows them alike; each keeps its
    fastest step. Returns {impl: {"seconds", "params_per_s", "max_abs_diff_vs_loop"}}: all start from the same
    weights and gradients, so the last number says how far each drifts from the loop (rounding only).
    """
    impls = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opts, params = {}, {}
    for impl, flags in impls.items():
        g = torch.Generator().manual_seed(0)
        tensors = [torch.nn.Parameter(torch.randn(numel // pieces, generator=g)) for _ in range(pieces)]
        for p in tensors:
            p.grad = torch.randn(p.shape, generator=g)
        opts[impl] = torch.optim.Adam(tensors, lr=1e-3, **flags)
        params[impl] = [p.detach() for p in tensors]   # views: they follow the steps
        opts[impl].step()            # creates the state: not part of the timing
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(repeats):
        for impl, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            best[impl] = min(best[impl], time.perf_counter() - t0)
    return {impl: {"seconds": best[impl], "params_per_s": numel / best[impl],
                   "max_abs_diff_vs_loop": max(float((a - b).abs().max()) for a, b in
                                               zip(params[impl], params["loop"], strict=True))}
            for impl in impls}


def transfer_seconds(nbytes: int, link: str) -> float:
    """Time to move nbytes at a link's peak bandwidth (LINKS): a lower bound, no latency or contention."""
    return nbytes / LINKS[link]
