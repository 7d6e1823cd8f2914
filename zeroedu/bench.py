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

`cpu_adam_speed` times torch's three CPU Adam implementations, the choice zeroedu.offload.CPU_ADAM makes for the
host step (notebook 08 shows it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from zeroedu.fmt import fmt_bytes
from zeroedu.vocab import MODEL_STATES


def _workload(d_model: int, layers: int):
    from zeroedu.models import TinyGPTConfig

    return TinyGPTConfig(vocab_size=512, seq_len=64, d_model=d_model, n_layer=layers, n_head=4)


MLP_CLASSES = 10


def bench_mlp(width: int = 1024, layers: int = 8, seed: int = 0) -> torch.nn.Sequential:
    """The MLP workload: `layers` blocks of Linear(width, width) + GELU, then a head to MLP_CLASSES classes."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, MLP_CLASSES))


class Workload:
    """A model the benchmark trains: how to build it, its blocks (one FSDP2 group each), its data and loss."""

    def __init__(self, kind: str = "gpt", width: int = 256, layers: int = 4) -> None:
        if kind not in ("gpt", "mlp"):
            raise ValueError(f"workload must be 'gpt' or 'mlp', got {kind!r}")
        self.kind, self.width, self.layers = kind, width, layers
        self.gpt = _workload(width, layers) if kind == "gpt" else None

    def model(self) -> torch.nn.Module:
        from zeroedu.models import TinyGPT

        return TinyGPT(self.gpt, seed=0) if self.gpt else bench_mlp(self.width, self.layers)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(model.blocks) if self.gpt else list(model)[: self.layers]

    def batch(self, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        from zeroedu.models import gpt_batch

        if self.gpt:
            return gpt_batch(step, n, self.gpt)
        g = torch.Generator().manual_seed(1234 * 100_003 + step)
        return torch.randn(n, self.width, generator=g), torch.randint(0, MLP_CLASSES, (n,), generator=g)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from zeroedu.models import gpt_loss, mlp_loss

        return gpt_loss(out, y) if self.gpt else mlp_loss(out, y)

    def describe(self) -> str:
        if self.gpt:
            return f"TinyGPT d_model={self.width} layers={self.layers}"
        return f"MLP {self.layers} x (Linear({self.width}, {self.width}) + GELU) + head"


def _peer_model(kind: str, work: Workload, device: torch.device):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = work.model().to(device)
    if kind in ("ddp", "zero_redundancy"):
        wrapped = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if kind == "ddp":
            return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3, fused=True)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                                fused=True)
    reshard = kind == "fsdp2_reshard"
    for block in work.blocks(model):
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)


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


PAIRS = [(0, "ddp", "DDP"), (1, "zero_redundancy", "ZeroRedundancyOptimizer"),
         (2, "fsdp2_keep", "FSDP2 reshard_after_forward=False"),
         (3, "fsdp2_reshard", "FSDP2 reshard_after_forward=True")]


DDP_BUCKET_MB = 25
# zeroedu's knobs; None: sized like the peer's (see zeroedu_config).
ZERO = {"reduce_bucket_size": None, "stage3_prefetch_bucket_size": None,
        "stage3_max_live_parameters": 1_000_000_000, "stage3_param_persistence_threshold": 10_000}


def zeroedu_config(stage: int, micro_batch: int, zero: dict | None = None, block: int = 1_000_000,
                   defaults: bool = False) -> dict:
    """The benchmark's zeroedu config: Adam in fp32 as the peers run it.

    Tuned (the default): buckets as big as the peer's. DDP (the peer of stages 0 and 1) all-reduces buckets of
    DDP_BUCKET_MB; FSDP2 (stages 2 and 3, one fully_shard per block) reduce-scatters, and gathers, one block of
    `block` elements at a time. defaults=True: nothing but the stage (and any knob given in `zero`), so
    zeroedu sizes its buffers itself, as a user who writes the shortest config gets."""
    given = {k: v for k, v in (zero or {}).items() if v is not None}
    if defaults:
        zero = given
    else:
        zero = {**ZERO, **given}
        if zero["reduce_bucket_size"] is None:
            zero["reduce_bucket_size"] = DDP_BUCKET_MB * 2**20 // 4 if stage < 2 else block
        if zero["stage3_prefetch_bucket_size"] is None:
            zero["stage3_prefetch_bucket_size"] = block
    return {"train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **zero}}


def _contenders(stage: int) -> list[str]:
    """Who takes turns in a stage's rounds: zeroedu, its peer, and at stage 3 zeroedu's stage 2 too (the
    communication-bound comparison: stage 3 sends 1.5x stage 2's bytes)."""
    return ["zeroedu", "peer"] + (["zeroedu stage 2"] if stage == 3 else [])


def _rank_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _take_turns(steps: dict[str, Callable], batches: list, warmup: int, rounds: int, device: torch.device,
                at_first_timed_round: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Every contender one step per round on the round's batch, the order rotating every round; the rounds after
    `warmup` are timed. A barrier starts each step, and on a GPU a synchronize ends it."""
    import torch.distributed as dist

    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        if r == warmup and at_first_timed_round is not None:
            at_first_timed_round()
        k = r % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            steps[name](*batches[r])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _bench_rank(rank: int, world: int, work: Workload, rounds: int, warmup: int, mb: int, zero: dict,
                defaults: bool) -> dict:
    """On every rank: each stage and its peer, one step each in turn (order rotating), same batches."""
    import torch.distributed as dist

    import zeroedu
    from zeroedu import theory
    from zeroedu.memory import resident
    from zeroedu.models import shard_batch

    device = _rank_device()
    batches = [[t.to(device) for t in shard_batch(*work.batch(s, mb * world), rank, world)]
               for s in range(warmup + rounds + 1)]
    block = max(sum(p.numel() for p in b.parameters()) for b in work.blocks(work.model()))
    out = {}
    for stage, peer, _ in PAIRS:
        steps, owned, engines, models, opts = {}, {}, {}, {}, {}
        for name in _contenders(stage):
            if name == "peer":
                model, opt = _peer_model(peer, work, device)
                models[name], opts[name] = model, opt

                def p_step(x, y, model=model, opt=opt):
                    work.loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()   # torch's default (set_to_none=True): the peers' usual, fastest path

                steps[name] = p_step
                owned[name] = lambda model=model, opt=opt: _peer_owned(model, opt)
                continue
            config = zeroedu_config(2 if name.endswith("stage 2") else stage, mb, zero, block, defaults)
            engine, *_ = zeroedu.initialize(model=work.model(), config=config)
            engines[name] = engine
            steps[name] = lambda x, y, e=engine: e.train_batch((x, y), work.loss)
            owned[name] = engine.owned
        row = {"times": _take_turns(steps, batches, warmup, rounds, device)}
        for name in steps:   # one more step each, under torch's MemTracker (not timed)
            dist.barrier()
            e = engines.get(name)
            external = [e.module, e.optimizer] if e else [models[name], opts[name]]
            row[f"{name}_resident"], row[f"{name}_peak"] = live_bytes(steps[name], batches[-1], external, owned[name]())
            row[f"{name}_states"] = sum(resident({c: owned[name]().get(c, []) for c in MODEL_STATES}).values())
        engine = engines["zeroedu"]
        persistent = [b.padded for b in engine.layout.buckets if b.index in getattr(engine, "persistent", ())]
        th = theory.model_state_bytes(engine.layout.numel, world, stage, "fp32", layout=[b.numel for b in
                                                                                      engine.layout.buckets])
        # Stage 3 also keeps units below stage3_param_persistence_threshold whole on every rank, by design.
        row["theory_states"] = th["total"] + 4 * sum(persistent)
        row["sent_per_step"] = engine.ledger.per_step(warmup)["total"]
        row["buckets"] = (engine.bucket_numel, getattr(engine, "prefetch_numel", None))
        out[stage] = row
        del engines, engine, steps, owned, models, opts
    out["device"] = f"{dist.get_backend()} on {device.type.upper()}"
    return out


def live_bytes(step, batch, external: list, owned: dict[str, list]) -> tuple[int, int]:
    """(resident after, peak during) one step, in bytes of all live tensors on this rank, by torch's MemTracker: it
    sees every tensor an operator makes on this thread and every storage resize (FSDP2 frees its gathered
    parameters by resizing their storage to 0), plus the modules, optimizers and tensors it is told about."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*external, *(t for ts in owned.values() for t in ts if isinstance(t, torch.Tensor)))
    with tracker:
        step(*batch)

    def total(snapshot: dict) -> int:
        return sum(by_kind.get("Total", 0) for by_kind in snapshot.values())

    return total(tracker.get_tracker_snapshot("current")), total(tracker.get_tracker_snapshot("peak"))


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the per-round ratios a / b, and their quartiles."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return statistics.geometric_mean(ratios), q1, q3


def run(world_size: int = 2, d_model: int = 256, layers: int = 4, rounds: int = 10, warmup: int = 2,
        micro_batch: int = 4, zero: dict | None = None, workload: str = "gpt", defaults: bool = False) -> list[dict]:
    """Rows of the benchmark table. Per round, a step takes as long as its slowest rank; the ratio is the
    geometric mean over rounds of zeroedu's step time over the peer's in the same round (quartiles of the
    per-round ratios show the spread). d_model is the MLP's width for workload="mlp"."""
    import zeroedu

    work = Workload(workload, d_model, layers)
    results = zeroedu.launch(_bench_rank, world_size=world_size, timeout=3600, hang_timeout=600,
                             args=(work, rounds, warmup, micro_batch, zero or {}, defaults))
    rows = []
    for stage, _, label in PAIRS:
        rs = [r[stage] for r in results]
        slowest = {n: [max(t) for t in zip(*(r["times"][n] for r in rs), strict=True)] for n in rs[0]["times"]}
        ratio, q1, q3 = _ratio(slowest["zeroedu"], slowest["peer"])
        row = {"stage": stage, "peer": label, "zeroedu_ms": 1e3 * statistics.median(slowest["zeroedu"]),
               "peer_ms": 1e3 * statistics.median(slowest["peer"]), "ratio": ratio, "ratio_q1": q1, "ratio_q3": q3,
               "rounds": len(slowest["zeroedu"]), "zeroedu_states": rs[0]["zeroedu_states"],
               "theory_states": rs[0]["theory_states"], "peer_states": rs[0]["peer_states"],
               "sent_per_step": rs[0]["sent_per_step"], "buckets": rs[0]["buckets"], "device": results[0]["device"],
               "workload": work.describe(), "defaults": defaults}
        for who in ("zeroedu", "peer"):
            row[f"{who}_peak"] = max(r[f"{who}_peak"] for r in rs)
            row[f"{who}_resident"] = max(r[f"{who}_resident"] for r in rs)
        if "zeroedu stage 2" in slowest:
            row["vs_stage2"] = _ratio(slowest["zeroedu"], slowest["zeroedu stage 2"])
        rows.append(row)
    return rows


def _mib(n: float, digits: int = 2) -> str:   # a table cell: the column header names the unit
    return fmt_bytes(n, "MiB", digits, label="", grouping=False)


def format_rows(rows: list[dict], world_size: int, d_model: int | None = None, layers: int | None = None) -> str:
    config = ("defaults: nothing but the stage in zero_optimization" if rows[0].get("defaults") else
              "tuned: buckets sized like the peer's")
    lines = [f"{rows[0].get('workload') or f'TinyGPT d_model={d_model} layers={layers}'}, fp32, fused Adam, "
             f"{world_size} ranks, {rows[0]['device']}, {rows[0]['rounds']} rounds; zeroedu {config}",
             "| stage | peer | zeroedu ms | peer ms | ratio: geometric mean (quartiles) | "
             "zeroedu resident / peak MiB | peer resident / peak MiB | zeroedu model states MiB (theory) | "
             "ledger MiB sent/step | buckets (reduce, prefetch) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = "=" if r["zeroedu_states"] == r["theory_states"] else "!="
        reduce, prefetch = r.get("buckets") or (None, None)
        sizes = f"{reduce:,}" + (f", {prefetch:,}" if r["stage"] == 3 else "")
        lines.append(f"| {r['stage']} | {r['peer']} | {r['zeroedu_ms']:.1f} | {r['peer_ms']:.1f} | "
                     f"{r['ratio']:.2f}x ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) | "
                     f"{_mib(r['zeroedu_resident'], 1)} / {_mib(r['zeroedu_peak'], 1)} | "
                     f"{_mib(r['peer_resident'], 1)} / {_mib(r['peer_peak'], 1)} | "
                     f"{_mib(r['zeroedu_states'])} {at} {_mib(r['theory_states'])} | "
                     f"{_mib(r['sent_per_step'])} | {sizes} |")
    for r in rows:
        if "vs_stage2" in r:
            g, q1, q3 = r["vs_stage2"]
            lines.append(f"\nstage 3 / zeroedu's own stage 2 (taking turns in stage 3's rounds): {g:.2f}x "
                         f"({q1:.2f}-{q3:.2f})")
    return "\n".join(lines)


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


OPS = ("all_reduce", "reduce_scatter", "all_gather")
IMPLS = ("ring", "direct", "native")


def _collective_rank(rank: int, world: int, sizes: list[int], repeats: int) -> dict:
    """Per size and op, each repeat runs every implementation once (the order rotating)."""
    import torch.distributed as dist

    from zeroedu.comm import Comm

    comms = {impl: Comm(implementation=impl) for impl in IMPLS}
    out = {}
    for numel in sizes:
        x = torch.ones(numel)
        piece = torch.ones(numel // world)
        for op in OPS:
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for r in range(repeats + 1):   # the first repeat warms up
                for impl in IMPLS[r % len(IMPLS):] + IMPLS[: r % len(IMPLS)]:
                    comm = comms[impl]
                    dist.barrier()
                    t0 = time.perf_counter()
                    if op == "all_reduce":
                        comm.all_reduce(x)
                    elif op == "reduce_scatter":
                        comm.reduce_scatter(piece, x)
                    else:
                        comm.all_gather(x, piece)
                    if r:
                        times[impl].append(time.perf_counter() - t0)
            out[numel, op] = times
    return out


def collectives(world_size: int = 4, sizes_kib: tuple[float, ...] = (64 * 1024,), repeats: int = 5) -> str:
    """zeroedu's ring and direct collectives vs gloo's own, per op and size: the measurement behind
    comm.AUTO_ON_GLOO."""
    import zeroedu

    sizes = [max(world_size, int(kib * 1024) // 4 // world_size * world_size) for kib in sizes_kib]
    r = zeroedu.launch(_collective_rank, world_size=world_size, args=(sizes, repeats), timeout=1800)
    lines = [f"fp32 tensors, {world_size} gloo ranks, median of {repeats} repeats, implementations taking turns "
             "(wall time on this CPU; a collective takes as long as its slowest rank)",
             "| op | tensor KiB | ring ms | direct ms | gloo ms | ring / gloo | direct / gloo |",
             "|---|---|---|---|---|---|---|"]
    for op in OPS:
        for numel in sizes:
            t = {impl: [max(x) for x in zip(*(rank[numel, op][impl] for rank in r), strict=True)] for impl in IMPLS}
            ratio = {impl: statistics.median(a / b for a, b in zip(t[impl], t["native"], strict=True))
                     for impl in IMPLS}
            ms = " | ".join(f"{1e3 * statistics.median(t[impl]):.2f}" for impl in IMPLS)
            lines.append(f"| {op} | {numel * 4 / 1024:g} | {ms} | {ratio['ring']:.2f}x | {ratio['direct']:.2f}x |")
    return "\n".join(lines)


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
        offload = _offload_rows(a.world_size, a.d_model, a.layers, a.rounds, a.warmup, a.micro_batch, zero)
        print("\n" + _format_offload_rows(offload, a.world_size, a.d_model, a.layers))
    print(f"\nratio = zeroedu step time / peer step time (below 1.0: zeroedu is faster), {rows[0]['device']}: "
          "gloo timings on a CPU say nothing about NCCL on GPUs.")
    return 0


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

    return p_step, lambda: _peer_owned(model, opt)


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

    cfg = _workload(d_model, layers)
    device = _rank_device()
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

    times = _take_turns(steps, batches, warmup, rounds, device, mark)
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


def _offload_rows(world_size: int = 2, d_model: int = 256, layers: int = 4, rounds: int = 10, warmup: int = 2,
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


def _format_offload_rows(rows: list[dict], world_size: int, d_model: int, layers: int) -> str:
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
        moved = f"{_mib(pcie)}, {_mib(disk)}"
        base = "" if r["vs_no_offload"] is None else f"{r['vs_no_offload']:.2f}x"
        lines.append(f"| {r['config']} | {r['ms']:.1f} | {med:.2f}x ({q1:.2f}-{q3:.2f}) | "
                     f"{r['vs_peer_default_adam']:.2f}x | {base} | {_mib(r['device'])} | {_mib(r['host'])} | "
                     f"{_mib(r['nvme'])} | {_mib(r['peak'], 1)} | {moved if m else ''} |")
    cols = ("forward", "backward", "step", "host Adam", "d2h + h2d", "NVMe I/O")
    lines += ["", "Where zeroedu's step time goes (rank 0, mean ms per timed step; host Adam runs inside the step "
              "phase, the gradient copies (d2h) on the comm thread during backward, NVMe I/O on its own thread)",
              "| config | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        if r["spent"]:
            lines.append(f"| {r['config']} | " + " | ".join(f"{r['spent'].get(c, 0.0):.1f}" for c in cols) + " |")
    return "\n".join(lines)
