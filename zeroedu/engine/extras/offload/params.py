"""Parameter offload (offload_param, stage 3), and the way every updated master piece reaches the parameters.

ParamOffloadMixin, one part of OffloadMixin: the setup that moves the compute-dtype parameter shard to the host
("cpu") or to a swap file ("nvme"); `write_back`, which brings the step's updated master piece to where the
compute parameters live (on the device, or their host or NVMe copy); `publish`; and `param_piece`, which brings
a unit's piece back to the device just before its all-gather.
"""

from __future__ import annotations

import queue

import torch

from zeroedu.engine.flat import Bucket


class ParamOffloadMixin:
    """offload_param's part of OffloadMixin, and write_back/publish for every offload setting."""

    # -- setup: the parameter shard to its tier ------------------------------------------------------------------
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

    # -- the update to the compute parameters, wherever they live ------------------------------------------------
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

            self._io_pending.append(self.submit(write, lane="io"))

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
