"""`zeroedu bench`: each zeroedu stage against torch's own implementation of the same idea, in one run.

Peers: DistributedDataParallel (stage 0), ZeroRedundancyOptimizer (stage 1), FSDP2 `fully_shard` with
`reshard_after_forward=False` (stage 2: gradients and optimizer state sharded, parameters kept after
forward) and `True` (stage 3). Same model, data, optimizer (torch's fused Adam, which zeroedu's engine uses)
and precision (fp32), same ranks, same run.
Reports step-time ratios (zeroedu / peer; below 1.0 is faster), peak and resident bytes per rank and the
bytes zeroedu's ledger counted. `--collectives` times zeroedu's ring collectives against gloo's own.

Each stage runs in turn with its peer, one step each, the order alternating every round, on the same
batches; warm-up steps are not timed; a step lasts as long as its slowest rank. The ratio is the geometric
mean of the per-round ratios: load that comes and goes on the machine hits both sides of a round alike, and
with the order alternating, whatever going first costs or gains cancels out over an even number of rounds.

Times are wall clock of the backend in use (gloo on this machine's CPU): gloo timings say nothing about NCCL
on GPUs. With a GPU per rank, zeroedu.launch picks NCCL and both sides run on the GPUs.

The package: pairs (the default table), profiling (--profile), collective_times (--collectives) and
offloading (--offload, and `cpu_adam_speed`: torch's three CPU Adam implementations timed, the choice
zeroedu.offload.CPU_ADAM makes for the host step, which notebook 08 shows).
"""

from __future__ import annotations

import argparse
import os

from zeroedu.bench.collective_times import collectives
from zeroedu.bench.offloading import cpu_adam_speed, format_offload_rows, offload_rows
from zeroedu.bench.pairs import ZERO, Workload, bench_mlp, format_rows, live_bytes, run, zeroedu_config
from zeroedu.bench.profiling import profile

__all__ = ["Workload", "bench_mlp", "collectives", "cpu_adam_speed", "format_rows", "live_bytes", "main", "profile",
           "run", "zeroedu_config"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zeroedu bench", description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, choices=[1, 2, 4])
    ap.add_argument("--workload", choices=["gpt", "mlp"], default="gpt",
                    help="gpt: TinyGPT (vocab 512, 64 tokens); mlp: --layers x (Linear(--width) + GELU) + a head")
    ap.add_argument("--d-model", "--width", dest="d_model", type=int, default=None,
                    help="TinyGPT's d_model (default 256) or the MLP's width (default 1024)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: gpt 4, mlp 8)")
    ap.add_argument("--rounds", type=int, default=10, help="timed steps of each contender (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each contender first")
    ap.add_argument("--micro-batch", type=int, default=None, help="samples per rank (default: gpt 4, mlp 8)")
    ap.add_argument("--defaults", action="store_true",
                    help="zeroedu's config is nothing but the stage (and the knobs given below): its own default "
                         "buffer sizes, as the shortest config gets them, instead of buckets sized like the peer's")
    for key, value in ZERO.items():
        ap.add_argument("--" + key.removeprefix("stage3_").replace("_", "-"), dest=key, type=int, default=None,
                        help=f"zero_optimization.{key} of zeroedu's config (default: "
                             f"{'sized like the peer' if value is None else value}; with --defaults: zeroedu's)")
    ap.add_argument("--collectives", action="store_true", help="time ring vs gloo collectives instead")
    ap.add_argument("--kib", type=float, nargs="+", default=[64 * 1024], help="tensor sizes for --collectives")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per size for --collectives")
    ap.add_argument("--offload", action="store_true", help="add offload rows against FSDP2 CPUOffloadPolicy")
    ap.add_argument("--profile", action="store_true",
                    help="instead: where zeroedu's stage 2 and stage 3 spend a step (phases, collectives)")
    a = ap.parse_args(argv)
    if a.collectives:
        print(collectives(a.world_size, tuple(a.kib), a.repeats))
        return 0
    mlp = a.workload == "mlp"
    a.d_model = a.d_model or (1024 if mlp else 256)
    a.layers = a.layers or (8 if mlp else 4)
    a.micro_batch = a.micro_batch or (8 if mlp else 4)
    if a.offload and (mlp or a.defaults):
        ap.error("--offload runs the gpt workload with tuned buckets; drop --workload mlp and --defaults")
    load = os.getloadavg()[0]
    zero = {key: getattr(a, key) for key in ZERO if getattr(a, key) is not None}   # the knobs given
    if a.profile:
        print(profile(a.world_size, a.workload, a.d_model, a.layers, a.rounds, a.warmup, a.micro_batch, zero,
                      a.defaults))
        print(f"\nload average (1 min) before: {load:.2f}, after: {os.getloadavg()[0]:.2f}, on {os.cpu_count()} cores")
        return 0
    rows = run(a.world_size, a.d_model, a.layers, a.rounds, a.warmup, a.micro_batch, zero, a.workload, a.defaults)
    print(format_rows(rows, a.world_size))
    print(f"\nload average (1 min) before: {load:.2f}, after: {os.getloadavg()[0]:.2f}, on {os.cpu_count()} cores")
    if a.offload:
        offload = offload_rows(a.world_size, a.d_model, a.layers, a.rounds, a.warmup, a.micro_batch, zero)
        print("\n" + format_offload_rows(offload, a.world_size, a.d_model, a.layers))
    print(f"\nratio = zeroedu step time / peer step time (below 1.0: zeroedu is faster), {rows[0]['device']}: "
          "gloo timings on a CPU say nothing about NCCL on GPUs.")
    return 0


