"""The host step's CPU Adam (`cpu_adam_speed`) and `zeroedu bench --offload`: zeroedu's offload against FSDP2 with
CPUOffloadPolicy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from zeroedu.bench.pairs import mib, peer_owned, rank_device, take_turns, workload_config, zeroedu_config
from zeroedu.theory.vocab import MODEL_STATES


# -- the host step's CPU Adam (zeroedu.offload.CPU_ADAM) -----------------------------------------------------------
def cpu_adam_speed(numel: int = 4_000_000, pieces: int = 8, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Time one Adam step over `numel` fp32 parameters (in `pieces` tensors) for each CPU implementation.

    The implementations take turns, step by step, so that a busy machine slows them alike; each keeps its
    fastest step. Returns {impl: {"seconds", "params_per_s", "max_abs_diff_vs_loop"}}: all start from the same
    weights and gradients, so the last number says how far each drifts from the loop (rounding only).
    """
    impls = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opts, params = {}, {}
    for impl, flags in impls.items():
        g = torch.Generator().manual_seed(0)
        tensors = [torch.nn.Parameter(torch.randn(numel // pieces, generator=g)) for _ in range(pieces)]
        for p in tensors:
            p.grad = torch.randn(p.shape, generator=g)
        opts[impl] = torch.optim.Adam(tensors, lr=1e-3, **flags)
        params[impl] = [p.detach() for p in tensors]   # views: they follow the steps
        opts[impl].step()            # creates the state: not part of the timing
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(repeats):
        for impl, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            best[impl] = min(best[impl], time.perf_counter() - t0)
    return {impl: {"seconds": best[impl], "params_per_s": numel / best[impl],
                   "max_abs_diff_vs_loop": max(float((a - b).abs().max()) for a, b in
                                               zip(params[impl], params["loop"], strict=True))}
            for impl in impls}


# -- offload rows (`zeroedu bench --offload`) ------------------------------------------------------------------
# zeroedu's offload settings against FSDP2 with CPUOffloadPolicy, which keeps the sharded parameters, gradients
# and optimizer state on the host and steps there (the setting that matches stage 3 + offload_optimizer cpu +
# offload_param cpu). The peer runs twice: with torch.optim.Adam as it comes (the per-tensor loop on CPU
# tensors) and with fused=True, the CPU Adam zeroedu's host step uses, so the offload machinery is compared with
# the same optimizer kernel. Every contender takes one step per round, in an order that rotates each round.

OFFLOAD_PEER = "FSDP2 + CPUOffloadPolicy, fused Adam"
OFFLOAD_PEERS = {   # name: (CPUOffloadPolicy?, torch.optim.Adam flags)
    "FSDP2": (False, {}),
    "FSDP2 + CPUOffloadPolicy": (True, {}),
    OFFLOAD_PEER: (True, {"fused": True}),
}


def _offload_contenders(nvme_path: str, pin: bool) -> dict[str, dict]:
    cpu = {"device": "cpu", "pin_memory": pin}
    nvme = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin}
    return {
        "stage 2": {"stage": 2},
        "stage 2 + opt cpu": {"stage": 2, "offload_optimizer": cpu},
        "stage 3": {"stage": 3},
        "stage 3 + opt cpu": {"stage": 3, "offload_optimizer": cpu},
        "stage 3 + opt cpu + param cpu": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu},
        "stage 3 + opt nvme + param nvme": {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme},
    }


def _offload_engines(cfg, mb: int, zero: dict, nvme_path: str, device: torch.device) -> dict:
    """zeroedu's offload contenders: the stage benchmark's config plus each one's offload keys."""
    import zeroedu
    from zeroedu.models import TinyGPT

    engines = {}
    for name, extra in _offload_contenders(nvme_path, device.type == "cuda").items():
        config = zeroedu_config(extra.pop("stage"), mb)
        config["zero_optimization"].update({**zero, **extra})
        engines[name], *_ = zeroedu.initialize(model=TinyGPT(cfg, seed=0), config=config)
    return engines


def _offload_peer_step(cfg, device: torch.device, offload: bool, adam: dict) -> tuple[Callable, Callable]:
    """FSDP2 (one fully_shard per block), with CPUOffloadPolicy if `offload`: its step and its owned tensors."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from zeroedu.models import TinyGPT, gpt_loss

    model = TinyGPT(cfg, seed=0).to(device)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")} if offload else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)

    def p_step(x, y):
        gpt_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return p_step, lambda: peer_owned(model, opt)


def _time_spent(e, marks: tuple[int, int], warmup: int, rounds: int) -> dict[str, float]:
    """Where the time of an engine's timed steps went on this rank, mean ms per step: its phases, the host's Adam,
    the copies and the NVMe I/O (from the ledger)."""
    phases: dict[str, float] = {}
    for phase, t0, t1 in e.timeline[marks[0]:]:
        phases[phase] = phases.get(phase, 0.0) + 1e3 * (t1 - t0) / rounds
    phases["host Adam"] = sum(1e3 * (t1 - t0) for _, t0, t1 in getattr(e, "adam_timeline", [])[marks[1]:])
    phases["host Adam"] /= rounds
    moves = [x for x in e.ledger.select(kind="offload") if warmup <= x.step < warmup + rounds]
    phases["d2h + h2d"] = sum(1e3 * x.seconds for x in moves if x.op in ("d2h", "h2d")) / rounds
    phases["NVMe I/O"] = sum(1e3 * x.seconds for x in moves if x.op in ("nvme2h", "h2nvme")) / rounds
    return phases


def _offload_rank(rank: int, world: int, d_model: int, layers: int, rounds: int, warmup: int, mb: int,
                  zero: dict, nvme_path: str) -> dict:
    import torch.distributed as dist

    from zeroedu.memory import PeakTracker, resident
    from zeroedu.models import gpt_batch, gpt_loss, shard_batch

    cfg = workload_config(d_model, layers)
    device = rank_device()
    batches = [[t.to(device) for t in shard_batch(*gpt_batch(s, mb * world, cfg), rank, world)]
               for s in range(warmup + rounds + 1)]
    engines = _offload_engines(cfg, mb, zero, nvme_path, device)
    steps = {name: (lambda x, y, e=e: e.train_batch((x, y), gpt_loss)) for name, e in engines.items()}
    owned = {name: e.owned for name, e in engines.items()}
    for name, (offload, adam) in OFFLOAD_PEERS.items():
        steps[name], owned[name] = _offload_peer_step(cfg, device, offload, adam)

    marks: dict[str, tuple[int, int]] = {}

    def mark() -> None:   # where the timed rounds start in each engine's timelines
        marks.update({n: (len(e.timeline), len(getattr(e, "adam_timeline", []))) for n, e in engines.items()})

    times = take_turns(steps, batches, warmup, rounds, device, mark)
    out: dict = {"times": times, "device": f"{dist.get_backend()} on {device.type.upper()}"}
    spent = {name: _time_spent(e, marks[name], warmup, rounds) for name, e in engines.items()}
    for name in steps:   # one more step each under the memory tracker (not timed), then bytes by tier
        dist.barrier()
        with PeakTracker(owned[name], lambda: "step") as tracker:
            steps[name](*batches[-1])
        row = {"peak": tracker.peak_total}
        if name in engines:
            e = engines[name]
            tiers = e.memory()["tiers"]
            row.update({t: sum(tiers.get(t, {}).get(c, 0) for c in MODEL_STATES) for t in ("device", "host", "nvme")})
            row["moved"] = e.ledger.by("op", kind="offload", step=warmup)
            row["spent"] = spent[name]
            if hasattr(e, "close"):
                e.close()
        else:   # FSDP2 with CPUOffloadPolicy keeps its model states on the host
            states = sum(resident({c: owned[name]().get(c, []) for c in MODEL_STATES}).values())
            row.update({"device": 0 if OFFLOAD_PEERS[name][0] else states, "host": states if OFFLOAD_PEERS[name][0]
                        else 0, "nvme": 0, "moved": {}})
        out[name] = row
    return out


def offload_rows(world_size: int = 2, d_model: int = 256, layers: int = 4, rounds: int = 10, warmup: int = 2,
                  micro_batch: int = 4, zero: dict | None = None, nvme_path: str | None = None) -> list[dict]:
    """One row per contender: median step time (a round's step lasts as long as its slowest rank), the median
    over rounds of its time over OFFLOAD_PEER's in the same round (with quartiles), over FSDP2 +
    CPUOffloadPolicy with torch's default Adam, and over the same zeroedu stage without offload; model-state
    bytes per rank by tier; bytes the ledger saw move between tiers in one step. nvme_path: a folder for the
    NVMe row (default: a temporary folder, which on most machines is not an NVMe drive)."""
    import shutil
    import tempfile

    import zeroedu

    path = nvme_path or tempfile.mkdtemp(prefix="zeroedu-bench-")
    try:
        results = zeroedu.launch(_offload_rank, world_size=world_size, timeout=3600, hang_timeout=600,
                                 args=(d_model, layers, rounds, warmup, micro_batch, zero or {}, path))
    finally:
        if nvme_path is None:
            shutil.rmtree(path, ignore_errors=True)
    slowest = {n: [max(t) for t in zip(*(r["times"][n] for r in results), strict=True)] for n in results[0]["times"]}

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        rs = sorted(x / y for x, y in zip(slowest[a], slowest[b], strict=True))
        q1, _, q3 = statistics.quantiles(rs, n=4) if len(rs) > 1 else (rs[0],) * 3
        return statistics.median(rs), q1, q3

    rows = []
    for name in slowest:
        base = name.split(" +")[0]
        r0 = results[0][name]
        rows.append({"config": name, "ms": 1e3 * statistics.median(slowest[name]), "vs_peer": ratio(name, OFFLOAD_PEER),
                     "vs_peer_default_adam": ratio(name, "FSDP2 + CPUOffloadPolicy")[0],
                     "vs_no_offload": ratio(name, base)[0] if base in slowest else None,
                     "peak": max(r[name]["peak"] for r in results), "device": r0["device"], "host": r0["host"],
                     "nvme": r0["nvme"], "moved": r0["moved"], "spent": r0.get("spent"), "rounds": len(slowest[name]),
                     "backend": results[0]["device"]})
    return rows


def format_offload_rows(rows: list[dict], world_size: int, d_model: int, layers: int) -> str:
    lines = [f"Offload: TinyGPT d_model={d_model} layers={layers}, fp32 Adam, {world_size} ranks, "
             f"{rows[0]['backend']}, {rows[0]['rounds']} rounds. Model states per rank by tier (on a machine "
             "without a GPU the device is the CPU: device and host are the same memory, kept apart as accounting)",
             f"| config | ms | vs {OFFLOAD_PEER} (quartiles) | vs FSDP2 + CPUOffloadPolicy (default Adam) | "
             "vs no offload | device MiB | host MiB | NVMe MiB | peak MiB | moved per step MiB (h<->d, h<->NVMe) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med, q1, q3 = r["vs_peer"]
        m = r["moved"]
        pcie, disk = m.get("d2h", 0) + m.get("h2d", 0), m.get("nvme2h", 0) + m.get("h2nvme", 0)
        moved = f"{mib(pcie)}, {mib(disk)}"
        base = "" if r["vs_no_offload"] is None else f"{r['vs_no_offload']:.2f}x"
        lines.append(f"| {r['config']} | {r['ms']:.1f} | {med:.2f}x ({q1:.2f}-{q3:.2f}) | "
                     f"{r['vs_peer_default_adam']:.2f}x | {base} | {mib(r['device'])} | {mib(r['host'])} | "
                     f"{mib(r['nvme'])} | {mib(r['peak'], 1)} | {moved if m else ''} |")
    cols = ("forward", "backward", "step", "host Adam", "d2h + h2d", "NVMe I/O")
    lines += ["", "Where zeroedu's step time goes (rank 0, mean ms per timed step; host Adam runs inside the step "
              "phase, the gradient copies (d2h) on the comm thread during backward, NVMe I/O on its own thread)",
              "| config | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        if r["spent"]:
            lines.append(f"| {r['config']} | " + " | ".join(f"{r['spent'].get(c, 0.0):.1f}" for c in cols) + " |")
    return "\n".join(lines)
