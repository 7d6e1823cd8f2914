"""Notebooks 05-10's harness: the paper's Table 1, offload configs and runs, and the node CPU's Adam time."""


from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch.distributed as dist

from zeroedu import theory


class Table1Row(NamedTuple):
    """One row of the ZeRO paper's Table 1: model states per device, in GB (1e9 bytes), at data-parallel degree N.

    A tuple too, so `n, *gb = row` and `row[1:]` read it as [N, stage 0, stage 1, stage 2, stage 3]."""

    world_size: int
    stage0: float
    stage1: float
    stage2: float
    stage3: float

    @property
    def by_stage(self) -> tuple[float, float, float, float]:
        """The four stages' GB, stage 0 first."""
        return self.stage0, self.stage1, self.stage2, self.stage3


def paper_table1(psi: float = 7.5e9, worlds: Sequence[int] = (1, 4, 16, 64, 256, 1024),
                 k: int = 12) -> list[Table1Row]:
    """Rows (N, stage 0, stage 1, stage 2, stage 3) in GB (1e9 bytes): model states per device for Psi parameters
    in mixed precision, over the data-parallel degree N, as the ZeRO paper's Table 1 sweeps it."""

    return [Table1Row(n, *(theory.model_state_bytes_paper(psi, n, s, k) / 1e9 for s in range(4))) for n in worlds]


def offload_config(stage: int, opt: str = "none", param: str = "none", nvme_path: str | None = None,
                   micro_batch: int = 4, bucket: int = 20_000) -> dict:
    """Notebook 08's config: bf16 + Adam at `stage`, optimizer state and (stage 3) parameters on the tier named
    ("none", "cpu" or "nvme"; NVMe needs nvme_path)."""
    def tier(device: str) -> dict:
        if device != "nvme":
            return {"device": device}
        if not nvme_path:
            raise ValueError("offload_config: the NVMe tier needs nvme_path= (a folder on a local disk)")
        return {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}

    return {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": tier(opt), "offload_param": tier(param)}}


def _swap_files(engine, root: str | None) -> dict[str, int]:
    import os

    out = {}
    for folder in getattr(engine, "swap_folders", []):
        for d, _, files in os.walk(folder):
            for f in files:
                out[os.path.relpath(os.path.join(d, f), root or folder)] = os.path.getsize(os.path.join(d, f))
    return out


def offload_runs(rank: int, world_size: int, configs: Mapping[str, Mapping], steps: int = 6,
                 nvme_path: str | None = None) -> dict:
    """Notebook 08's launch: every config trained side by side, **taking turns step by step** (one step of each
    engine, then the next step of each), so that a machine that gets busier or quieter during the run slows them
    alike; the first step (warm-up: first-touch allocations, Adam creating its state) is left out of the times.

    Per config: the losses, the step times ("seconds": the fastest timed step; "median"), bytes by tier, the
    offload ledger of the last step, the last step's timeline and the NVMe swap files."""
    import statistics

    import zeroedu
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    engines = {name: zeroedu.initialize(model=TinyGPT(seed=0), config=dict(cfg))[0] for name, cfg in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    losses: dict[str, list[float]] = {name: [] for name in configs}
    starts: dict[str, float] = {}
    for s in range(steps):
        xs, ys = shard_batch(*gpt_batch(s, 4 * world_size), rank, world_size)
        for name, engine in engines.items():
            dist.barrier()
            t0 = time.time()
            losses[name].append(engine.train_batch((xs, ys), gpt_loss))
            times[name].append(time.time() - t0)
            starts[name] = t0
    out = {}
    last = steps - 1
    for name, engine in engines.items():
        t0 = starts[name]
        out[name] = {
            # the fastest step: on a machine shared with other jobs, the one least disturbed by them
            "losses": losses[name], "seconds": min(times[name][1:]), "median": statistics.median(times[name][1:]),
            "times": times[name],
            "tiers": engine.memory()["tiers"], "layout": [b.numel for b in engine.layout.buckets],
            "psi": sum(b.numel for b in engine.layout.buckets),
            "moved": engine.ledger.by("op", kind="offload", step=last),
            "moved_by_phase": engine.ledger.by("phase", "op", kind="offload", step=last),
            "copy_seconds": engine.ledger.by("op", field="seconds", kind="offload", step=last),
            "phases": {p: e - b for p, b, e in engine.timeline if b >= t0},
            "adam_seconds": sum(e - b for _, b, e in getattr(engine, "adam_timeline", []) if b >= t0),
            "timeline": {"t0": t0, "compute": [c for c in engine.timeline if c[1] >= t0],
                         "adam": [a for a in getattr(engine, "adam_timeline", []) if a[1] >= t0],
                         "events": [(e.op, e.kind, e.start, e.seconds) for e in engine.ledger if e.start >= t0]},
            "files": _swap_files(engine, nvme_path),
        }
        if hasattr(engine, "close"):
            engine.close()        # deletes this rank's NVMe swap folder
    return out


def cpu_adam_node_seconds(psi: float, gpus_per_node: int, nodes: int, params_per_s: float) -> dict[str, float]:
    """The host optimizer step of ZeRO-Offload, per step: every rank steps its Psi/N shard on the CPU, and the
    gpus_per_node ranks of a node share that node's CPU, so one node steps Psi/nodes parameters, whatever the
    number of GPUs inside it. `params_per_s`: a whole node's CPU Adam rate."""
    n = gpus_per_node * nodes
    return {"shard_params": psi / n, "node_params": psi / nodes, "node_seconds": psi / nodes / params_per_s}


