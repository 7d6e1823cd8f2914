"""The default benchmark: each zeroedu stage and its torch peer on the same workload, taking turns step by step;
the workloads, the contenders, the alternating rounds, live bytes per rank and the table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from zeroedu.fmt import fmt_bytes
from zeroedu.theory.vocab import MODEL_STATES


def workload_config(d_model: int, layers: int):
    from zeroedu.models import TinyGPTConfig

    return TinyGPTConfig(vocab_size=512, seq_len=64, d_model=d_model, n_layer=layers, n_head=4)


MLP_CLASSES = 10


def bench_mlp(width: int = 1024, layers: int = 8, seed: int = 0) -> torch.nn.Sequential:
    """The MLP workload: `layers` blocks of Linear(width, width) + GELU, then a head to MLP_CLASSES classes."""
    from zeroedu.models import seeded

    with seeded(seed):   # the same weights whatever another thread draws meanwhile
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(width, MLP_CLASSES))


class Workload:
    """A model the benchmark trains: how to build it, its blocks (one FSDP2 group each), its data and loss."""

    def __init__(self, kind: str = "gpt", width: int = 256, layers: int = 4) -> None:
        if kind not in ("gpt", "mlp"):
            raise ValueError(f"workload must be 'gpt' or 'mlp', got {kind!r}")
        self.kind, self.width, self.layers = kind, width, layers
        self.gpt = workload_config(width, layers) if kind == "gpt" else None

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


def peer_owned(model, opt):
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
        "stage3_max_live_parameters": 1_000_000_000, "stage3_param_persistence_threshold": 10_000,
        "stage3_max_reuse_distance": 0}


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
    return ["zeroedu", "peer"] + (["zeroedu stage 2"] if stage == 3 else []) + ["limit"]


def rank_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def take_turns(steps: dict[str, Callable], batches: list, warmup: int, rounds: int, device: torch.device,
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


class Limit:
    """What this machine allows a stage's step: its compute with no communication, plus the transfer of its bytes
    with no compute, one collective after another. Both are measured in the same rounds as the stage itself.

    compute: forward and backward of a plain copy of the model on this rank's micro-batch, and fused Adam over the
    elements this rank steps (the whole model at stage 0, 1/N of it at stages 1-3), as one flat piece.
    transfer: the collectives of the stage's newest complete step, as its ledger lists them (op, elements, dtype),
    replayed through a Comm of the same implementation (ring, direct or gloo's own per op), with the ranks
    synchronized by a barrier in between, so that neither side waits for the other's compute.

    A stage at 1.0x its limit hides nothing and loses nothing; below 1.0x it overlaps transfers with compute;
    above, the excess is the engine's own work (hooks, copies, bookkeeping) and whatever overlap costs.
    """

    def __init__(self, work: Workload, engine, device: torch.device) -> None:
        from zeroedu.comm import Comm

        self.model, self.loss, self.engine = work.model().to(device), work.loss, engine
        stepped = sum(p.numel() for p in engine.master_pieces)
        self.piece = torch.zeros(stepped, device=device, requires_grad=True)
        self.piece.grad = torch.zeros_like(self.piece)
        self.adam = torch.optim.Adam([self.piece], lr=1e-3, fused=True)
        self.comm = Comm(implementation=engine.comm.implementation)
        self.device, self.plan, self.buffers = device, None, []
        self.compute: list[float] = []
        self.transfer: list[float] = []

    def _replay_plan(self) -> None:
        """Buffers for the collectives of the engine's newest complete optimizer step (made outside the timing)."""
        step = self.engine.global_step - 1
        plan = tuple((e.op, e.numel, e.dtype) for e in self.engine.ledger
                     if e.step == step and e.phase != "init" and e.kind in ("params", "grads", "scalar")
                     and e.op in ("all_reduce", "reduce_scatter", "all_gather"))
        if plan == self.plan:
            return
        n = self.comm.world_size
        self.plan, self.buffers = plan, []
        for op, numel, dtype in plan:
            full = -(-numel // n) * n
            t = torch.empty(full, dtype=getattr(torch, dtype), device=self.device)
            self.buffers.append((op, t, torch.empty(full // n, dtype=t.dtype, device=self.device)))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        import torch.distributed as dist

        self._replay_plan()
        t0 = time.perf_counter()
        self.loss(self.model(x), y).backward()
        self.adam.step()
        for p in self.model.parameters():
            p.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        for op, full, piece in self.buffers:
            if op == "all_reduce":
                self.comm.all_reduce(full)
            elif op == "reduce_scatter":
                self.comm.reduce_scatter(piece, full)
            else:
                self.comm.all_gather(full, piece)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compute.append(t1 - t0)
        self.transfer.append(time.perf_counter() - t2)


def _bench_rank(rank: int, world: int, work: Workload, rounds: int, warmup: int, mb: int, zero: dict,
                defaults: bool) -> dict:
    """On every rank: each stage and its peer, one step each in turn (order rotating), same batches."""
    import torch.distributed as dist

    import zeroedu
    from zeroedu import theory
    from zeroedu.memory import resident
    from zeroedu.models import shard_batch

    device = rank_device()
    batches = [[t.to(device) for t in shard_batch(*work.batch(s, mb * world), rank, world)]
               for s in range(warmup + rounds + 1)]
    block = max(sum(p.numel() for p in b.parameters()) for b in work.blocks(work.model()))
    out = {}
    for stage, peer, _ in PAIRS:
        steps, owned, engines, models, opts = {}, {}, {}, {}, {}
        for name in _contenders(stage):
            if name == "limit":   # after zeroedu's engine: it replays that engine's collectives
                limit = Limit(work, engines["zeroedu"], device)
                steps[name] = limit.step
                continue
            if name == "peer":
                model, opt = _peer_model(peer, work, device)
                models[name], opts[name] = model, opt

                def p_step(x, y, model=model, opt=opt):
                    work.loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()   # torch's default (set_to_none=True): the peers' usual, fastest path

                steps[name] = p_step
                owned[name] = lambda model=model, opt=opt: peer_owned(model, opt)
                continue
            config = zeroedu_config(2 if name.endswith("stage 2") else stage, mb, zero, block, defaults)
            engine, *_ = zeroedu.initialize(model=work.model(), config=config)
            engines[name] = engine
            steps[name] = lambda x, y, e=engine: e.train_batch((x, y), work.loss)
            owned[name] = engine.owned
        row = {"times": take_turns(steps, batches, warmup, rounds, device)}
        row["limit_compute"], row["limit_transfer"] = limit.compute[warmup:], limit.transfer[warmup:]
        del steps["limit"]
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
        del engines, engine, steps, owned, models, opts, limit
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
        # The limit of a round: the slowest rank's compute plus the slowest rank's transfer.
        compute = [max(t) for t in zip(*(r["limit_compute"] for r in rs), strict=True)]
        transfer = [max(t) for t in zip(*(r["limit_transfer"] for r in rs), strict=True)]
        limit = [c + t for c, t in zip(compute, transfer, strict=True)]
        row["limit_ms"], row["compute_ms"], row["transfer_ms"] = (1e3 * statistics.median(v)
                                                                  for v in (limit, compute, transfer))
        row["vs_limit"] = _ratio(slowest["zeroedu"], limit)
        row["peer_vs_limit"] = _ratio(slowest["peer"], limit)
        rows.append(row)
    return rows


def _fmt_ratio(r: tuple[float, float, float]) -> str:
    g, q1, q3 = r
    return f"{g:.2f}x ({q1:.2f}-{q3:.2f})"


def mib(n: float, digits: int = 2) -> str:   # a table cell: the column header names the unit
    return fmt_bytes(n, "MiB", digits, label="", grouping=False)


def format_rows(rows: list[dict], world_size: int, d_model: int | None = None, layers: int | None = None) -> str:
    config = ("defaults: nothing but the stage in zero_optimization" if rows[0].get("defaults") else
              "tuned: buckets sized like the peer's")
    lines = [f"{rows[0].get('workload') or f'TinyGPT d_model={d_model} layers={layers}'}, fp32, fused Adam, "
             f"{world_size} ranks, {rows[0]['device']}, {rows[0]['rounds']} rounds; zeroedu {config}",
             "| stage | peer | zeroedu ms | peer ms | ratio: geometric mean (quartiles) | "
             "zeroedu resident / peak MiB | peer resident / peak MiB | zeroedu model states MiB (theory) | "
             "ledger MiB sent/step | buckets (reduce, prefetch) | limit ms (compute + transfer) | "
             "zeroedu / limit | peer / limit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = "=" if r["zeroedu_states"] == r["theory_states"] else "!="
        reduce, prefetch = r.get("buckets") or (None, None)
        sizes = f"{reduce:,}" + (f", {prefetch:,}" if r["stage"] == 3 else "")
        lines.append(f"| {r['stage']} | {r['peer']} | {r['zeroedu_ms']:.1f} | {r['peer_ms']:.1f} | "
                     f"{r['ratio']:.2f}x ({r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}) | "
                     f"{mib(r['zeroedu_resident'], 1)} / {mib(r['zeroedu_peak'], 1)} | "
                     f"{mib(r['peer_resident'], 1)} / {mib(r['peer_peak'], 1)} | "
                     f"{mib(r['zeroedu_states'])} {at} {mib(r['theory_states'])} | "
                     f"{mib(r['sent_per_step'])} | {sizes} | "
                     f"{r['limit_ms']:.1f} ({r['compute_ms']:.1f} + {r['transfer_ms']:.1f}) | "
                     f"{_fmt_ratio(r['vs_limit'])} | {_fmt_ratio(r['peer_vs_limit'])} |")
    for r in rows:
        if "vs_stage2" in r:
            g, q1, q3 = r["vs_stage2"]
            lines.append(f"\nstage 3 / zeroedu's own stage 2 (taking turns in stage 3's rounds): {g:.2f}x "
                         f"({q1:.2f}-{q3:.2f})")
    return "\n".join(lines)


