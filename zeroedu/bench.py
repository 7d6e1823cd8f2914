"""`zeroedu bench`: each zeroedu stage against torch's own implementation of the same idea, in one run.

Peers: DistributedDataParallel (stage 0), ZeroRedundancyOptimizer (stage 1), FSDP2 `fully_shard` with
`reshard_after_forward=False` (stage 2: gradients and optimizer state sharded, parameters kept after
forward) and `True` (stage 3). Same model, data, optimizer and precision (fp32), same ranks, same run.
Reports step-time ratios (zeroedu / peer; below 1.0 is faster), peak and resident bytes per rank and the
bytes zeroedu's ledger counted. `--collectives` times zeroedu's ring collectives against gloo's own.

Times are wall clock of gloo on this machine's CPU: they say nothing about NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _workload(d_model: int, layers: int):
    from zeroedu.models import TinyGPTConfig

    return TinyGPTConfig(vocab_size=512, seq_len=64, d_model=d_model, n_layer=layers, n_head=4)


def _peer_model(kind: str, cfg):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zeroedu.models import TinyGPT

    model = TinyGPT(cfg, seed=0)
    if kind in ("ddp", "zero_redundancy"):
        wrapped = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if kind == "ddp":
            return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    reshard = kind == "fsdp2_reshard"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _peer_owned(model, opt):
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    state = getattr(opt, "optim", opt).state
    return {
        "parameters": [local(p.data) for p in model.parameters()],
        "gradients": [local(p.grad) for p in model.parameters() if p.grad is not None],
        "optimizer_state": [local(v) for s in state.values() for v in s.values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0],
    }


def _bench_rank(rank: int, world: int, d_model: int, layers: int, steps: int, mb: int) -> dict:
    import torch.distributed as dist

    import zeroedu
    from zeroedu.memory import PeakTracker, resident
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    cfg = _workload(d_model, layers)
    out = {}

    def timed(step_fn, owned):
        times = []
        tracker = None
        for s in range(steps):
            x, y = gpt_batch(s, mb * world, cfg)
            xs, ys = shard_batch(x, y, rank, world)
            dist.barrier()
            t0 = time.perf_counter()
            if s == steps - 1:   # the last step measured for memory, not time
                tracker = PeakTracker(owned, lambda: "step")
                with tracker:
                    step_fn(xs, ys)
            else:
                step_fn(xs, ys)
                times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times[1:]), "peak": tracker.peak_total,
                "resident": sum(resident(owned()).values())}

    for stage in range(4):
        ds = {"train_micro_batch_size_per_gpu": mb, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000,
                                    "stage3_param_persistence_threshold": 10_000,
                                    "stage3_prefetch_bucket_size": 5_000_000}}
        engine, *_ = zeroedu.initialize(model=TinyGPT(cfg, seed=0), config=ds)

        def z_step(xs, ys, engine=engine):
            engine.train_batch((xs, ys), gpt_loss)

        r = timed(z_step, engine.owned)
        states = ("parameters", "gradients", "master_weights", "optimizer_state")
        r["resident"] = sum(engine.memory()["resident"].get(c, 0) for c in states)
        r["sent_per_step"] = engine.ledger.per_step(2)["total"]
        out[f"zeroedu{stage}"] = r
        del engine

    for kind in ("ddp", "zero_redundancy", "fsdp2_keep", "fsdp2_reshard"):
        model, opt = _peer_model(kind, cfg)

        def p_step(xs, ys, model=model, opt=opt):
            opt.zero_grad(set_to_none=False)
            gpt_loss(model(xs), ys).backward()
            opt.step()

        out[kind] = timed(p_step, lambda model=model, opt=opt: _peer_owned(model, opt))
        del model, opt
    return out


PAIRS = [(0, "ddp", "DDP"), (1, "zero_redundancy", "ZeroRedundancyOptimizer"),
         (2, "fsdp2_keep", "FSDP2 reshard_after_forward=False"),
         (3, "fsdp2_reshard", "FSDP2 reshard_after_forward=True")]


def run(world_size: int = 2, d_model: int = 256, layers: int = 4, steps: int = 8, micro_batch: int = 4) -> list[dict]:
    import zeroedu

    results = zeroedu.launch(_bench_rank, world_size=world_size, args=(d_model, layers, steps, micro_batch),
                             timeout=1800, hang_timeout=300)
    rows = []
    for stage, peer, label in PAIRS:
        z = [r[f"zeroedu{stage}"] for r in results]
        p = [r[peer] for r in results]
        zt = max(x["seconds"] for x in z)   # a step is as slow as its slowest rank
        pt = max(x["seconds"] for x in p)
        rows.append({"stage": stage, "peer": label, "zeroedu_ms": 1e3 * zt, "peer_ms": 1e3 * pt,
                     "ratio": zt / pt, "zeroedu_peak": max(x["peak"] for x in z),
                     "peer_peak": max(x["peak"] for x in p), "zeroedu_resident": z[0]["resident"],
                     "peer_resident": p[0]["resident"], "sent_per_step": z[0]["sent_per_step"]})
    return rows


def format_rows(rows: list[dict], world_size: int, d_model: int, layers: int) -> str:
    mib = 1 << 20
    lines = [f"TinyGPT d_model={d_model} layers={layers}, fp32 Adam, {world_size} gloo ranks on CPU",
             "| stage | peer | zeroedu ms | peer ms | ratio | zeroedu peak MiB | peer peak MiB | "
             "zeroedu model states MiB | peer states MiB | ledger MiB sent/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['peer']} | {r['zeroedu_ms']:.1f} | {r['peer_ms']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['zeroedu_peak'] / mib:.1f} | {r['peer_peak'] / mib:.1f} | "
                     f"{r['zeroedu_resident'] / mib:.2f} | {r['peer_resident'] / mib:.2f} | "
                     f"{r['sent_per_step'] / mib:.2f} |")
    return "\n".join(lines)


def _collective_rank(rank: int, world: int, numel: int, repeats: int) -> dict:
    import torch.distributed as dist

    from zeroedu.comm import Comm

    out = {}
    for impl in ("ring", "native"):
        comm = Comm(implementation=impl)
        x = torch.ones(numel)
        piece = torch.ones(numel // world)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                if op == "all_reduce":
                    comm.all_reduce(x)
                elif op == "reduce_scatter":
                    comm.reduce_scatter(piece, x)
                else:
                    comm.all_gather(x, piece)
                times.append(time.perf_counter() - t0)
            out[(impl, op)] = statistics.median(times)
    return out


def collectives(world_size: int = 4, mib: int = 64, repeats: int = 5) -> str:
    import zeroedu

    numel = (mib << 20) // 4 // world_size * world_size
    r = zeroedu.launch(_collective_rank, world_size=world_size, args=(numel, repeats), timeout=900)
    lines = [f"{mib} MiB fp32 tensor, {world_size} gloo ranks, median of {repeats} (wall time on this CPU)",
             "| op | zeroedu ring ms | gloo ms | ring / gloo |", "|---|---|---|---|"]
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        ring = max(x[("ring", op)] for x in r)
        nat = max(x[("native", op)] for x in r)
        lines.append(f"| {op} | {1e3 * ring:.1f} | {1e3 * nat:.1f} | {ring / nat:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zeroedu bench", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, choices=[1, 2, 4])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--collectives", action="store_true", help="time ring vs gloo collectives instead")
    ap.add_argument("--mib", type=int, default=64, help="tensor size for --collectives")
    ap.add_argument("--offload", action="store_true", help="add offload rows against FSDP2 CPUOffloadPolicy")
    a = ap.parse_args(argv)
    if a.collectives:
        print(collectives(a.world_size, a.mib))
        return 0
    rows = run(a.world_size, a.d_model, a.layers, a.steps, a.micro_batch)
    print(format_rows(rows, a.world_size, a.d_model, a.layers))
    if a.offload:
        from zeroedu.offload import bench_offload

        for row in bench_offload(a.world_size):
            print(row)
    print("\nratio = zeroedu step time / peer step time (below 1.0: zeroedu is faster). gloo on CPU, not NCCL.")
    return 0
