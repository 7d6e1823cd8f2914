"""`zeroedu bench --profile`: where a zeroedu step's time goes (rank 0's engine timeline and ledger)."""

from __future__ import annotations

import statistics
import time

from zeroedu.bench.pairs import Workload, zeroedu_config


def _profile_rank(rank: int, world: int, work: Workload, steps: int, warmup: int, mb: int, zero: dict,
                  defaults: bool) -> dict:
    """zeroedu's stages 2 and 3 taking turns; per timed step: the engine's phases and its ledger's collectives."""
    import torch.distributed as dist

    import zeroedu
    from zeroedu.models import shard_batch

    engines = {s: zeroedu.initialize(model=work.model(), config=zeroedu_config(s, mb, zero, defaults=defaults))[0]
               for s in (2, 3)}
    batches = [shard_batch(*work.batch(i, mb * world), rank, world) for i in range(warmup + steps)]
    times: dict[int, list[float]] = {s: [] for s in engines}
    marks: dict[int, tuple[int, int]] = {}
    for i in range(warmup + steps):
        if i == warmup:
            marks = {s: (len(e.timeline), len(e.ledger)) for s, e in engines.items()}
        for s in ((2, 3) if i % 2 == 0 else (3, 2)):
            dist.barrier()
            t0 = time.perf_counter()
            engines[s].train_batch(batches[i], work.loss)
            if i >= warmup:
                times[s].append(time.perf_counter() - t0)
    out = {}
    for s, e in engines.items():
        phases: dict[str, float] = {}
        for name, t0, t1 in e.timeline[marks[s][0]:]:
            phases[name] = phases.get(name, 0.0) + 1e3 * (t1 - t0) / steps
        ops: dict[str, tuple[float, float]] = {}
        for x in list(e.ledger)[marks[s][1]:]:
            n, ms = ops.get(f"{x.phase}/{x.op}", (0.0, 0.0))
            ops[f"{x.phase}/{x.op}"] = (n + 1 / steps, ms + 1e3 * x.seconds / steps)
        out[s] = {"step": 1e3 * statistics.median(times[s]), "phases": phases, "ops": ops}
    return out


def profile(world_size: int = 2, workload: str = "mlp", d_model: int = 1024, layers: int = 8, steps: int = 12,
            warmup: int = 4, micro_batch: int = 8, zero: dict | None = None, defaults: bool = True) -> str:
    """Where zeroedu's stage 2 and stage 3 spend a step (rank 0): the phases from the engine's timeline, and each
    kind of collective's count and wall time on the thread that ran it (waits for the other ranks included)."""
    import zeroedu

    work = Workload(workload, d_model, layers)
    r = zeroedu.launch(_profile_rank, world_size=world_size, timeout=3600, hang_timeout=600,
                       args=(work, steps, warmup, micro_batch, zero or {}, defaults))[0]
    kinds = sorted({k for s in r for k in r[s]["ops"]})
    lines = [f"{work.describe()}, {world_size} ranks, zeroedu {'defaults' if defaults else 'tuned'}: rank 0, ms per "
             f"step over {steps} steps (stages 2 and 3 taking turns); collectives as count: ms",
             "| stage | step (median) | forward | backward | step phase | " + " | ".join(kinds) + " |",
             "|---|---|---|---|---|" + "---|" * len(kinds)]
    for s in (2, 3):
        ph, ops = r[s]["phases"], r[s]["ops"]
        cells = [f"{ops[k][0]:.0f}: {ops[k][1]:.0f}" if k in ops else "-" for k in kinds]
        lines.append(f"| {s} | {r[s]['step']:.0f} | {ph.get('forward', 0):.0f} | {ph.get('backward', 0):.0f} | "
                     f"{ph.get('step', 0):.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


