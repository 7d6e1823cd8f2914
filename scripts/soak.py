"""Soak: a long stage-3 run of a tiny model, and whether each rank's resident memory stays flat.

    .venv/bin/python scripts/soak.py                      # 20,000 steps, 2 ranks, bar: < 4 MiB after warm-up
    .venv/bin/python scripts/soak.py --ledger unbounded --steps 10000   # every ledger entry kept, for comparison
    .venv/bin/python scripts/soak.py --trim-timeline       # engine.timeline kept to its last 1,000 phases

Each rank samples its resident set size (VmRSS, /proc/self/status) every `--every` steps. After the warm-up
(the first `--warmup` steps: allocator pools, the ledger's window filling up) the growth from the warm-up's end
to the run's end must stay under `--bar-mib`. `--ledger unbounded` runs with `ledger.max_entries = None` (every
entry kept, as before the ledger was bounded) for comparison. `engine.timeline` (three (phase, start, end) tuples
a step) is bounded by the engine too (it keeps between 5,000 and 10,000 phases, zeroedu.engine.trim_timeline);
`--trim-timeline` keeps it tighter still, to 1,000 phases. A benchmark with a bar, not a timed test:
the step time it prints depends on the machine and its load. Linux only (VmRSS).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeroedu  # noqa: E402


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak_rank(rank: int, world_size: int, steps: int, every: int, keep_all: bool, trim_timeline: bool) -> dict:
    import torch.nn.functional as F

    from zeroedu.models import Quirky, quirky_batch, shard_batch

    engine, *_ = zeroedu.initialize(model=Quirky(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 60, "stage3_param_persistence_threshold": 0}})
    if keep_all:
        engine.ledger.max_entries = engine.ledger.max_steps = None
    batches = [shard_batch(*quirky_batch(s, 4 * world_size), rank, world_size) for s in range(64)]
    samples, t0 = [], time.perf_counter()
    for s in range(steps):
        x, y = batches[s % len(batches)]
        engine.backward(F.cross_entropy(engine(x).flatten(0, 1), y.flatten()))
        engine.step()
        if trim_timeline and len(engine.timeline) > 1_200:
            del engine.timeline[:-1_000]
        if (s + 1) % every == 0 or s + 1 == steps:
            samples.append((s + 1, _rss_bytes(), len(engine.ledger), len(engine.timeline)))
    return {"samples": samples, "seconds": time.perf_counter() - t0,
            "per_step": engine.ledger.per_step(steps - 1), "totals_calls": engine.ledger.totals(field="calls")}


def growth(samples: list[tuple], warmup: int) -> tuple[int, int]:
    """(RSS at the first sample at or after warm-up, the largest RSS after it minus that)."""
    after = [sample[1] for sample in samples if sample[0] >= warmup]
    return after[0], max(after) - after[0]


def report(name: str, results: list[dict], warmup: int, bar: float) -> bool:
    ok = True
    mib = 2**20
    for rank, r in enumerate(results):
        base, grew = growth(r["samples"], warmup)
        steps, rss_end, entries, phases = r["samples"][-1]
        verdict = "flat" if grew < bar * mib else "GROWS"
        ok &= grew < bar * mib
        print(f"{name:9s} rank {rank}: {steps:,} steps, {1e3 * r['seconds'] / steps:.2f} ms/step; RSS "
              f"{base / mib:.1f} MiB at step {warmup:,} -> {rss_end / mib:.1f} MiB at the end, largest growth "
              f"{grew / mib:+.2f} MiB (bar {bar} MiB: {verdict}); ledger entries kept {entries:,} of "
              f"{r['totals_calls']['total']:,} counted; engine.timeline {phases:,} phases")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--every", type=int, default=500, help="steps between memory samples")
    parser.add_argument("--warmup", type=int, default=2_000, help="steps before the flatness bar applies")
    parser.add_argument("--bar-mib", type=float, default=4.0, help="largest RSS growth allowed after warm-up")
    parser.add_argument("--ledger", choices=("bounded", "unbounded", "both"), default="bounded",
                        help="the ledger's default window, every entry kept, or one run of each")
    parser.add_argument("--trim-timeline", action="store_true", help="keep engine.timeline to 1,000 phases")
    args = parser.parse_args(argv)
    print(f"soak: stage 3, Quirky ({args.world_size} ranks, gloo), {args.steps:,} steps"
          f"{', engine.timeline trimmed' if args.trim_timeline else ''}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    runs = [(name, name == "unbounded") for name in ("bounded", "unbounded") if args.ledger in (name, "both")]
    ok = True
    for name, keep_all in runs:
        results = zeroedu.launch(soak_rank, args.world_size, args=(args.steps, args.every, keep_all,
                                                                   args.trim_timeline))
        passed = report(name, results, args.warmup, args.bar_mib)
        ok &= passed or keep_all   # the unbounded run is the comparison, expected to grow
        samples = results[0]["samples"]
        print(f"{name:9s} RSS by step, rank 0 (MiB): " + ", ".join(
            f"{s[0]:,}: {s[1] / 2**20:.1f}" for s in samples[:: max(1, len(samples) // 10)]))
    if args.ledger == "unbounded":
        print("no bar: the unbounded run is the comparison, expected to grow")
        return 0
    print("PASS: resident memory flat after warm-up" if ok else "FAIL: resident memory grew after warm-up")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
