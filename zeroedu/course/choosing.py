"""Notebook 13's check of the planner: timing the ring collectives and fitting a link's alpha and beta."""


from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from zeroedu import theory
from zeroedu.course.basics import min_time
from zeroedu.i18n import tr

# -- the choosing notebook's check of the planner ---------------------------------------------------------------
RING_SWEEP = tuple(16 * 1024 * 4**k for k in range(6))       # 16 KiB ... 16 MiB, as notebook 02 sweeps


def time_ring_collectives(sizes: Sequence[int] = RING_SWEEP, tries: int = 3) -> list[tuple[str, int, int, float]]:
    """On a rank: time zeroedu's ring all-reduce, reduce-scatter and all-gather of each size in bytes (fp32), the
    fastest of `tries` (each after a barrier, min_time). Returns (op, bytes, world size, seconds) samples for
    calibrate_link (or planner.calibrate). The sweep reaches 16 MiB: below about 1 MiB a loaded CPU's times are
    mostly latency and scatter, and only the large sizes show the bandwidth."""
    from zeroedu.comm import Comm
    world_size = dist.get_world_size()
    comm, samples = Comm(implementation="ring"), []
    for nbytes in sizes:
        x, piece = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world_size)
        run = {"all_reduce": lambda x=x: comm.all_reduce(x, average=False),
               "reduce_scatter": lambda x=x, piece=piece: comm.reduce_scatter(piece, x, average=False),
               "all_gather": lambda x=x, piece=piece: comm.all_gather(x, piece)}
        samples += [(op, nbytes, world_size, min_time(fn, tries)) for op, fn in run.items()]
    return samples


def calibrate_link(samples: Iterable[tuple[str, int, int, float]], name: str = "this machine",
                   source: str = "timed ring collectives") -> tuple:
    """planner.calibrate for a notebook: (Link, note), and never an error on flat, noisy timings.

    `samples` are (op, nbytes, world_size, seconds), as time_ring_collectives returns them. When the times grow
    with the bytes, this is planner.calibrate's alpha-beta fit and `note` is "". On a loaded machine they may not:
    every size takes about as long as the scheduler lets it, the best-fitting line slopes down, and
    theory.fit_alpha_beta refuses it ("times do not grow with bytes"). Then alpha is set to 0 and beta is the
    least-squares bandwidth on the relative error (theory.fit_alpha_beta's own fallback when alpha comes out
    negative), and `note` says so in a sentence a notebook can show next to the numbers."""
    from zeroedu.theory import planner

    samples = list(samples)
    try:
        return planner.calibrate(samples, name=name, source=source), ""
    except ValueError as err:
        if "do not grow with bytes" not in str(err):
            raise
    rows = [(theory.ring_sent_bytes(op, nbytes, n), seconds) for op, nbytes, n, seconds in samples
            if op in theory.RING_OPS and n > 1]
    per_s = [sent / seconds for sent, seconds in rows]             # each sample's own bandwidth, bytes/s
    beta = sum(b * b for b in per_s) / sum(per_s)                  # argmin of sum (sent / (beta t) - 1)^2
    link = planner.Link(name, 0.0, beta, f"alpha set to 0, beta fitted alone, to {len(rows)} collectives from "
                                         f"{source}")
    gbps = f"{beta / 1e9:.2f}"
    note = tr("These timings do not grow with the message size (the machine was busy: each collective took about "
              "as long as the scheduler let it), so no line with a positive latency and bandwidth fits them. "
              f"The fit falls back to **alpha = 0** and the least-squares bandwidth, **beta = {gbps} GB/s**: read "
              "this fit as this run's noise, not as this machine's network.",
              "这些耗时不随消息大小增长（机器很忙：每次集合通信花多久取决于调度器），所以找不到延迟和带宽都为正的"
              f"直线来拟合。拟合退回到 **alpha = 0** 和最小二乘带宽 **beta = {gbps} GB/s**：把它当作这次运行的噪声，"
              "而不是这台机器的网络。")
    return link, note


def ledger_of_one_step(rank: int, world_size: int, d_model: int = 128, n_layer: int = 4) -> tuple[dict, int]:
    """Train a TinyGPT two steps at every stage, with ring collectives, no overlap and no stage-3 prefetch, so
    that each collective's time in the ledger is its own. Returns ({stage: the ledger rows of step 1}, psi)."""
    import zeroedu
    from zeroedu.models import TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss, shard_batch
    cfg, steps = TinyGPTConfig(d_model=d_model, n_layer=n_layer), {}
    for stage in theory.STAGES:
        engine, *_ = zeroedu.initialize(model=TinyGPT(cfg, seed=0), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True}, "comm_implementation": "ring",
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, "overlap_comm": False,
                                  "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}})
        for step in range(2):
            x, y = shard_batch(*gpt_batch(step, 2 * world_size, cfg), rank, world_size)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
        steps[stage] = [r for r in engine.ledger.rows() if r["step"] == 1 and r["kind"] in ("params", "grads")]
    return steps, engine.layout.numel


def clock_and_ledger(rank: int, world_size: int) -> dict:
    """One launch of notebook 13: the timed collectives (the clock) and one step's ledger at every stage."""
    samples = time_ring_collectives()
    steps, psi = ledger_of_one_step(rank, world_size)
    return {"samples": samples, "steps": steps, "psi": psi}


def slowest_rank_samples(results: Sequence[dict]) -> list[tuple[str, int, int, float]]:
    """Each timed collective at the time of its slowest rank: a collective ends when its last rank is done."""
    return [(op, nbytes, n, max(r["samples"][i][3] for r in results))
            for i, (op, nbytes, n, _) in enumerate(results[0]["samples"])]
