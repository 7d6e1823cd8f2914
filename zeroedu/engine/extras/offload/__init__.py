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

The package, one file per part: swap.py (swap folders and files on NVMe), transfers.py (copies and file I/O, each
a ledger entry; LINKS), optimizer.py (offload_optimizer), params.py (offload_param, and how
the updated master reaches the parameters). This file composes OffloadMixin from them and holds what spans both
tiers: setup, memory by tier, close, and the choice of CPU Adam.
"""

from __future__ import annotations

import os
import queue

import torch
import torch.distributed as dist

from zeroedu.comm.worker import Handle
from zeroedu.engine import make_optimizer
from zeroedu.engine.extras.offload.optimizer import OptimizerOffloadMixin
from zeroedu.engine.extras.offload.params import ParamOffloadMixin
from zeroedu.engine.extras.offload.swap import (
    MARKER,
    PREFIX,
    OffloadError,
    SwapFile,
    SwapFolder,
    check_nvme_path,
    remove_stale,
)
from zeroedu.engine.extras.offload.transfers import LINKS, TransferMixin, transfer_seconds
from zeroedu.engine.report import Timeline
from zeroedu.memory import resident

__all__ = ["CPU_ADAM", "LINKS", "MARKER", "PREFIX", "OffloadError", "OffloadMixin", "OptimizerOffloadMixin",
           "ParamOffloadMixin", "SwapFile", "SwapFolder", "TransferMixin", "check_nvme_path", "host_optimizer",
           "remove_stale", "transfer_seconds"]

CPU_ADAM = "fused"
"""Which torch Adam runs the host step: "fused" (one C++ kernel over every piece), "foreach" (vectorized ops over
lists of tensors) or "loop" (one tensor at a time, torch's default on CPU). `zeroedu.bench.cpu_adam_speed()`
measures them, the implementations taking turns step by step, best of 5 steps, on this 2-core machine under a
load average of 11-19: 4M fp32 parameters in 8 tensors, 1 thread (as each of 2 launched ranks runs): fused 3.4 ms,
loop 39 ms, foreach 46 ms; 2 threads, over several runs: fused 15-59 ms, foreach 86-274 ms, loop 198-564 ms; 16M
in 16 tensors: fused 77-299 ms, foreach 913-1399 ms, loop 1494-1744 ms. Fused was the fastest in every run but
one disturbed sample. It differs from the loop by about one float32 rounding (2e-7); foreach and loop agree bit
for bit. Set it (zeroedu.offload.CPU_ADAM, read here when the engine builds its optimizer) before `initialize`."""


def host_optimizer(cfg, params: list[torch.nn.Parameter], impl: str | None = None) -> torch.optim.Optimizer:
    """The configured optimizer, in the CPU implementation `impl` (default CPU_ADAM) for Adam and AdamW."""
    impl = impl or CPU_ADAM
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    if impl not in flags:
        raise ValueError(f"zeroedu.offload.CPU_ADAM must be 'fused', 'foreach' or 'loop', got {impl!r}")
    if cfg.optimizer.type not in ("Adam", "AdamW"):
        return make_optimizer(cfg, params)
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[cfg.optimizer.type]
    return cls(params, **{**flags[impl], **cfg.optimizer.params})   # optimizer.params.fused, if given, wins


# -- the engine ----------------------------------------------------------------------------------------------------

class OffloadMixin(ParamOffloadMixin, OptimizerOffloadMixin, TransferMixin):
    """offload_optimizer (stages 1-3) and offload_param (stage 3), layered on a stage by compose.engine_class.

    Each hook is overridden by one part only (params.py, optimizer.py, or this class), so the parts' order here
    changes nothing; each calls on to the stage below.
    """

    keeps_parameter_copies = True   # the fp32 master (and offload_param's pieces) live on the host or NVMe
    fuse_backward = False   # the copy of a reduced piece to the host is queued right behind its reduce-scatter

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
        self.adam_timeline = Timeline()   # (what, start, end) of host optimizer work, bounded as engine.timeline
        self.nvme_removed: list[str] = []                          # stale swap folders this run deleted
        self.written_back = False        # has this step's update already reached the compute parameters?
        self.start_side_stream()   # CUDA: the copies' stream (transfers.py says why it is not a lane)
        self._folders: dict[str, SwapFolder] = {}
        self._io_pending: list[Handle] = []   # NVMe writes on the worker's io lane, waited for before a read
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

    def close(self) -> None:
        """Finish NVMe I/O and delete this rank's swap folders (interpreter exit does it too, if not done)."""
        self._wait_io()
        for folder in self._folders.values():
            folder.close()
