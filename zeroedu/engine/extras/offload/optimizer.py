"""Optimizer offload (offload_optimizer, stages 1-3): the fp32 master pieces and the optimizer state on the host
("cpu") or in swap files ("nvme"), and the step on the CPU.

OptimizerOffloadMixin, one part of OffloadMixin: the setup that moves the master and state off the device, the
backward hooks that stream each bucket's reduced gradient piece to the host, the step (all pieces at once on the
host, or sub-group by sub-group through NVMe), and the checkpoint hooks that read and write master and state
wherever they live. Which CPU Adam runs the step (CPU_ADAM, host_optimizer) is set in zeroedu.offload itself.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from zeroedu.comm.worker import Handle
from zeroedu.engine.extras.offload.swap import OffloadError, SwapFile
from zeroedu.engine.flat import Bucket


def _state_bytes_per_element(cfg) -> int:
    """fp32 bytes of elementwise optimizer state per parameter (for the disk-space check before training)."""
    kind, kw = cfg.optimizer.type, cfg.optimizer.params
    if kind in ("Adam", "AdamW"):
        return 12 if kw.get("amsgrad") else 8
    return 4 if kw.get("momentum", 0) else 0


class OptimizerOffloadMixin:
    """offload_optimizer's part of OffloadMixin: master and optimizer state on the host or NVMe, the step there."""

    # -- setup: master and optimizer state to their tier -------------------------------------------------------
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
        self.group_decay(list(range(len(self.master_pieces))))   # each parameter group's weight decay, if they differ
        self.optimizer.step()
        for master in self.master_pieces:
            master.grad = None
        self.adam_timeline.append(("adam", t0, time.time()))

    @staticmethod
    def _scaled(g: torch.Tensor, coef: float) -> torch.Tensor:
        return g if (g.dtype == torch.float32 and coef == 1.0) else g.float().mul_(coef)   # as Engine does

    def _nvme_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """Sub-group by sub-group: read (nvme2h), step, write back (h2nvme), buffer_count sub-groups in host memory.

        The worker's io lane runs reads and writes in the order they are submitted. Sub-group i uses buffer i mod k;
        the read of sub-group i + k - 1 is submitted before sub-group i steps, after the write of the previous
        user of its buffer (sub-group i - 1), so it overlaps the step and never overwrites unsaved data.
        """
        k, ahead = self.buffer_count, self.buffer_count - 1
        buckets, pieces = self.layout.buckets, self.master_pieces
        reads: dict[int, Handle] = {}
        writes: list[Handle] = []

        def read(i: int) -> None:
            reads[i] = self.submit(partial(self._swap_in, i, self.slots[i % k], self.global_step), lane="io")

        for i in range(min(ahead, len(pieces))):
            read(i)
        for i, (b, master, g) in enumerate(zip(buckets, pieces, grads, strict=True)):
            if i + ahead < len(pieces) and ahead > 0:
                read(i + ahead)
            if i not in reads:
                read(i)
            reads.pop(i).wait()
            t0 = time.time()
            master.grad = self._scaled(g, coef)
            self.group_decay([i])    # on the piece just read in, before the optimizer steps it
            self.optimizer.step()    # only this piece has a gradient: Adam skips the others
            master.grad = None
            self.adam_timeline.append(("adam", t0, time.time()))
            self.write_back(b, master.detach())   # copied or cast out of the buffer before its next read
            writes.append(self.submit(partial(self._swap_out, i, self.global_step), lane="io"))
        for w in writes:
            w.wait()

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

