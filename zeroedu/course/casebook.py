"""Notebook 17, the casebook: the ten things DeepSpeed ZeRO users open issues about, each reproduced on CPU ranks.

`cases(rank, world, save_dir)` runs every case in one launch (starting ranks is the slow part on 2 cores) and
returns plain numbers; `masters_and_lr()` is the one case that needs no ranks. Every case trains the course's
TinyGPT in bf16 with Adam on the deterministic batches of zeroedu.models; each is a handful of steps, so the whole
launch takes seconds. What a case measures is bytes, counts and flags, which hold on every CPU; the one timing
(case 2) is returned separately and shown as a timing of this machine, under whatever load it has.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

import zeroedu
from zeroedu.models import MLP, TinyGPT, gpt_batch, gpt_loss, shard_batch

DS_BUCKET = 500_000_000          # DeepSpeed 0.19.8's reduce_bucket_size and allgather_bucket_size (elements)
DS_PREFETCH = 50_000_000         # stage3_prefetch_bucket_size
DS_LIVE = DS_REUSE = 1_000_000_000   # stage3_max_live_parameters, stage3_max_reuse_distance
DS_PERSIST = 100_000             # stage3_param_persistence_threshold


def config(stage: int, accum: int = 1, **zero) -> dict:
    """bf16 + Adam at `stage`, a global batch of 8 on 2 ranks split into `accum` micro-steps."""
    return {"train_batch_size": 8, "gradient_accumulation_steps": accum, "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **zero}}


def deepspeed_defaults(stage: int) -> dict:
    """DeepSpeed's own sizes written out (zeroedu sizes them to the model when left out): what a user who leaves
    them out gets in DeepSpeed."""
    zero = {"reduce_bucket_size": DS_BUCKET, "overlap_comm": stage == 3}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=DS_PREFETCH, stage3_max_live_parameters=DS_LIVE,
                    stage3_max_reuse_distance=DS_REUSE, stage3_param_persistence_threshold=DS_PERSIST)
    return zero


def _steps(engine, rank: int, world: int, steps: int = 2, track: int | None = None) -> list[float]:
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, 8)
        tracking = engine.track_memory() if s == track else None
        if tracking:
            tracking.__enter__()
        for m in range(engine.gradient_accumulation_steps()):
            xs, ys = shard_batch(x, y, rank, world, m, engine.gradient_accumulation_steps())
            loss = gpt_loss(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if tracking:
            tracking.__exit__(None, None, None)
    return losses


def run_case(rank: int, world: int, cfg: dict, steps: int = 2, track: int | None = 1) -> dict:
    """Train; return the step's ledger (bytes and calls per phase/op), the peak by category and the resident
    model states."""
    engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=cfg)
    _steps(engine, rank, world, steps, track)
    mem = engine.memory()
    return {"bytes": engine.ledger.per_step(1), "calls": engine.ledger.per_step(1, field="calls"),
            "peak": mem["peak"], "peak_total": mem["peak_total"], "resident": mem["resident"],
            "model_states": mem["model_states"], "bucket_high": getattr(engine, "bucket_bytes_high", 0),
            "psi": sum(p.numel() for p in TinyGPT(seed=0).parameters())}


def _saved_model(rank: int, world: int, save_dir: str) -> dict:
    """Case 5: what a stage-3 model's own state_dict holds on a rank, and what save_16bit_model writes with and
    without stage3_gather_16bit_weights_on_model_save."""
    out = {}
    for gather in (False, True):
        cfg = config(3, stage3_gather_16bit_weights_on_model_save=gather, stage3_param_persistence_threshold=0)
        engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=cfg)
        _steps(engine, rank, world, 1)
        sd = engine.module.state_dict()
        folder = os.path.join(save_dir, f"gather-{gather}")
        wrote = engine.save_16bit_model(folder)
        path = os.path.join(folder, "pytorch_model.bin")
        out[gather] = {"state_dict_bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                       "wrote": wrote, "file_bytes": os.path.getsize(path) if rank == 0 and wrote else None}
    return out


def _step_seconds(rank: int, world: int) -> dict:
    """Case 2's timing: stage 2 and stage 3 (units released after each use) take turns step by step, 4 steps
    each after a warm-up; the median step of each, on this machine under its load."""
    engines = {s: zeroedu.initialize(model=TinyGPT(seed=0), config=config(
        s, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0))[0] for s in (2, 3)}
    times: dict[int, list[float]] = {2: [], 3: []}
    for i in range(5):
        for s, engine in engines.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _steps(engine, rank, world, 1)
            if i:
                times[s].append(time.perf_counter() - t0)
    return {s: sorted(t)[len(t) // 2] for s, t in times.items()}


def cases(rank: int, world: int, save_dir: str) -> dict:
    """Every case's numbers on this rank (see the notebook for what each shows)."""
    from zeroedu.course_big import init_peaks

    r: dict = {}
    # 1: a higher stage holding more: stage 2's bucket at DeepSpeed's 5e8; stage 3 at DeepSpeed's prefetch sizes.
    for stage in (1, 2, 3):
        r["1", stage] = run_case(rank, world, config(stage, **deepspeed_defaults(stage)))
    # 2 and 6: stage 3 on a small model: collectives per step, with units released (reuse 0) and with DeepSpeed's
    # persistence threshold; bucket sizes.
    r["2", "s3-released"] = run_case(rank, world, config(3, stage3_param_persistence_threshold=0,
                                                     stage3_max_reuse_distance=0))
    r["2", "s2"] = run_case(rank, world, config(2))
    for bucket in (2_000, 20_000, DS_BUCKET):
        r["6", bucket] = run_case(rank, world, config(2, reduce_bucket_size=bucket, overlap_comm=False))
    # 4: offload: the bytes that cross the "PCIe" (device <-> host copies) per step.
    off = zeroedu.initialize(model=TinyGPT(seed=0), config=config(2, offload_optimizer={"device": "cpu"}))[0]
    _steps(off, rank, world, 2)
    r["4"] = {op: sum(e.tensor_bytes for e in off.ledger.select(op=op, step=1)) for op in ("d2h", "h2d")}
    # 5: the tiny saved model.
    r["5"] = _saved_model(rank, world, save_dir)
    # 7: every rank building the full model, with and without zero.Init (notebook 12's harness).
    sizes = (32,) + (64,) * 24 + (10,)   # many small layers, as in notebook 12
    built = init_peaks(rank, world, sizes)
    r["7"] = {"peak without Init": built.whole, "peak with Init": built.inside,
              "fp32 model": 4 * sum(p.numel() for p in MLP(sizes).parameters())}
    # 8: accumulation: bytes per optimizer step at 1 and 4 micro-steps, stages 1, 2, 3.
    # (stages 2 and 3 at one micro-step are case 2's runs: the same configs)
    r["8", 2, 1], r["8", 3, 1] = r["2", "s2"]["bytes"]["total"], r["2", "s3-released"]["bytes"]["total"]
    for stage, accum in ((1, 1), (1, 4), (2, 4), (3, 4)):
        run = run_case(rank, world, config(stage, accum, stage3_param_persistence_threshold=0))
        r["8", stage, accum] = run["bytes"]["total"]
    # 9: hpZ on one "node" (M = N = 2): the secondary shard, and what it changes in bytes (M = 1 is case 2's run).
    r["9", 1] = r["2", "s3-released"]
    r["9", 2] = run_case(rank, world, config(3, zero_hpz_partition_size=2, stage3_param_persistence_threshold=0,
                                         stage3_max_reuse_distance=0))
    r["timing"] = _step_seconds(rank, world)
    return r


@dataclass
class AccumBytes:
    """Case 8 at one stage: the bytes a rank sends per optimizer step, without and with gradient accumulation."""

    stage: int
    accum: int      # A, the micro-steps per optimizer step of the second run
    one: int        # bytes per step at 1 micro-step
    many: int       # bytes per step at A micro-steps


def accumulation_bytes(rank: int, world: int, stage: int, accum: int) -> AccumBytes:
    """Case 8 for one stage and one A (notebook 17's try-it cell): the same global batch of 8 in 1 and in `accum`
    micro-steps, every parameter partitioned at stage 3 (no persistence threshold), as case 8's runs."""
    sent = [run_case(rank, world, config(stage, a, stage3_param_persistence_threshold=0), track=None)["bytes"]["total"]
            for a in (1, accum)]
    return AccumBytes(stage, accum, *sent)


def masters_and_lr(steps: int = 6, lr: float = 1e-3) -> dict:
    """Case 10, one process: a bf16 weight of 1.0 stepped by Adam directly (no fp32 master, what FSDP does when the
    model is loaded in bf16 and nothing upcasts it) and through an fp32 master copy (DeepSpeed's mixed precision).
    bf16 has 8 bits of mantissa, so next to 1.0 an update smaller than half its spacing (2**-8) rounds away."""
    out = {}
    for master in (False, True):
        w = torch.ones(1024, dtype=torch.bfloat16)
        p = torch.nn.Parameter(w.float() if master else w.clone())
        opt = torch.optim.Adam([p], lr=lr)
        history = []
        for _ in range(steps):
            p.grad = torch.ones_like(p)          # Adam's first steps move each weight by about lr
            opt.step()
            history.append(float(p.detach().to(torch.bfloat16).float().mean()))
        out[master] = history
    return out
