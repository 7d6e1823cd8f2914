"""Functions that run inside launched ranks (zeroedu.launch ships them to the child processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zeroedu
from zeroedu.models import shard_batch

from reference import LR, batch, loss_fn, make


def config(stage: int, precision: str = "fp32", accum: int = 1, clip: float = 0.0, bucket: int = 3000,
           micro: int = 2, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": zero.pop("scale_power", 8),
                 "hysteresis": zero.pop("hysteresis", 2)},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                              "stage3_param_persistence_threshold": zero.pop("persist", 0), **zero},
    }


def train(rank: int, world: int, model: str, cfg: dict, steps: int = 4, global_batch: int = 8,
          track_step: int | None = None) -> dict:
    """Train with zeroedu; return what the tests compare (losses are the global-batch mean)."""
    engine, *_ = zeroedu.initialize(model=make(model), config=cfg)
    losses = run_steps(engine, model, rank, world, steps, global_batch=global_batch, track_step=track_step)
    return {
        "losses": losses,
        "params": engine.master_state_dict(),
        "ledger": {s: engine.ledger.per_step(s) for s in range(steps)},
        "scalars": len(engine.ledger.select(kind="scalar", step=1)),
        "memory": engine.memory(),
        "layout": [b.numel for b in engine.layout.buckets],
        "persistent": sorted(engine.layout.buckets[u].numel for u in getattr(engine, "persistent", ())),
        "skipped": engine.skipped_steps,
        "skip_entries": len(engine.ledger.select(op="skipped_step")),
        "scale": engine.scaler.scale,
    }


def run_steps(engine, model: str, rank: int, world: int, steps: int, first: int = 0, global_batch: int = 8,
              track_step: int | None = None) -> list[float]:
    """`steps` optimizer steps on the global batches first, first + 1, ... (each split over the ranks and the
    engine's micro-steps); returns each step's loss, the global-batch mean. `track_step`: the step (counted from
    0) whose memory the engine tracks."""
    losses = []
    for s in range(steps):
        x, y = batch(model, first + s, global_batch)
        total = torch.zeros(())
        tracking = engine.track_memory() if s == track_step else None
        if tracking:
            tracking.__enter__()
        for micro in range(engine.accum):
            xs, ys = shard_batch(x, y, rank, world, micro, engine.accum)
            loss = loss_fn(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if tracking:
            tracking.__exit__(None, None, None)
        dist.all_reduce(total)   # outside the engine: not in its ledger
        losses.append(float(total) / (world * engine.accum))
    return losses


def many(rank: int, world: int, runs: list[tuple]) -> dict:
    """Several trainings in one launch (starting ranks is the slow part on 2 cores)."""
    return {key: train(rank, world, *args) for key, *args in runs}


def torch_peer(rank: int, world: int, kind: str, steps: int = 4, global_batch: int = 8) -> dict:
    """torch's own data parallelism on the same data: DDP (stage 0) or ZeroRedundancyOptimizer (stage 1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make("gpt"))
    if kind == "ddp":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    losses = []
    for s in range(steps):
        x, y = batch("gpt", s, global_batch)
        xs, ys = shard_batch(x, y, rank, world)
        loss = loss_fn(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}
