"""One all-reduce, started two ways with the same code.

    python examples/torchrun_allreduce.py [world_size]          # zeroedu.launch starts the ranks (default 2)
    torchrun --nproc-per-node 2 examples/torchrun_allreduce.py  # torchrun starts them; launch() runs fn here

Rank r contributes r + 1, so every rank must see the sum 1 + 2 + ... + world_size.
"""

import os
import sys

import torch
import torch.distributed as dist

import zeroedu


def allreduce(rank: int, world_size: int) -> dict:
    x = torch.tensor([float(rank + 1)], device="cuda" if dist.get_backend() == "nccl" else "cpu")  # NCCL: GPU only
    dist.all_reduce(x)
    return {"rank": rank, "sum": x.item(), "backend": dist.get_backend()}


def main() -> None:
    world_size = int(os.environ.get("WORLD_SIZE") or (sys.argv[1] if len(sys.argv) > 1 else 2))
    results = zeroedu.launch(allreduce, world_size=world_size)
    here = os.environ.get("RANK", "launcher")
    print(f"[{here}] ranks {[r['rank'] for r in results]} all_reduce sums {[r['sum'] for r in results]} "
          f"expected {world_size * (world_size + 1) / 2} backend {results[0]['backend']}", flush=True)


if __name__ == "__main__":
    main()
