"""What runs on the ranks in notebooks 11 (activations, ZeRO-R) and 12 (big models, ZeRO in the real world).

Each function runs on every rank under `zeroedu.launch` and returns plain data (numbers, ledgers as tuples) that
the notebook prints and checks in the parent: output printed in a rank does not reach a notebook cell under nbval.
Keeping them here keeps the notebooks' cells short; tests/test_course_big.py runs them on real ranks.

Notebook 11: `zero_r` (P_a over a tensor-parallel group, CPU and contiguous checkpoints at stage 3) and
`bucket_bytes` (C_B: stage 2's bucket buffers with a fixed `reduce_bucket_size` and sized to the model), both in
one launch (`nb11_ranks`).
Notebook 12: `big_models` (zero.Init's construction peak and a memory cap, GatheredParameters, the 16-bit save,
bytes per parameter with fp32 gradient accumulation, FSDP2 next to stages 2 and 3) on 2 ranks, and `hsdp_vs_hpz`
(FSDP2's HSDP on a 2 x 2 mesh next to zeroedu's hpZ, and training at stage 3 under the cap) on 4 ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

import zeroedu


# -- notebook 11 -----------------------------------------------------------------------------------------------
@dataclass
class TensorParallelRun:
    """zero_r (a) on one rank: three TensorParallelMLP layers, each block checkpointed."""

    kept_bytes: int                      # bytes saved for backward on this rank (SavedActivations' total)
    gathers: list[tuple[str, int]]       # the activation collectives (before each recompute): (op, bytes sent)


@dataclass
class Stage3Run:
    """zero_r (b) on one rank: TinyGPT at stage 3, every block checkpointed, two steps."""

    losses: list[torch.Tensor]           # this rank's loss at each step
    block0_bytes: int                    # what block 0 keeps on the device for backward (the last step)
    stats: dict                          # zeroedu.checkpointing.stats(): recomputes, host_bytes_peak, ...
    host_copies: list[tuple[str, int]]   # the activation copies in the ledger: (op, bytes)


@dataclass
class ZeroR:
    """zero_r's result: (a) without and with partition_activations, (b) without and with the ZeRO-R section."""

    unpartitioned: TensorParallelRun
    partitioned: TensorParallelRun
    stage3_plain: Stage3Run
    stage3_zero_r: Stage3Run


class BucketRun(NamedTuple):
    """bucket_bytes' result for one model and bucket setting."""

    parameters: int          # the model's parameters (engine.layout.numel)
    bucket_elements: int     # the bucket size the engine used
    bucket_bytes_high: int   # the most bytes of bucket buffers alive at once on this rank


def zero_r(rank: int, world: int) -> ZeroR:
    """(a) three TensorParallelMLP layers split over the ranks, checkpointed with and without
    `partition_activations` over the tensor-parallel group: bytes kept for backward, the all-gathers before
    recompute. (b) TinyGPT at stage 3, checkpointing each block, without and with the ZeRO-R section
    (partitioned, on the host, in a contiguous buffer): losses, block 0's device bytes, checkpointing's stats and
    host copies."""
    from zeroedu import activation_checkpointing as checkpointing
    from zeroedu.comm import Comm
    from zeroedu.memory import SavedActivations
    from zeroedu.models import TensorParallelMLP, TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss, shard_batch

    tp, s3, comm = {}, {}, Comm()
    for part in (False, True):                         # (a) tensor parallelism, t = world
        checkpointing.configure({"activation_checkpointing": {"partition_activations": part}}, tp_comm=comm)
        mlps = [TensorParallelMLP(64, comm, seed=i) for i in range(3)]
        h = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        with SavedActivations(exclude=[p for m in mlps for p in m.parameters()]) as meter:
            for m in mlps:
                h = h + checkpointing.checkpoint(m, h)
            loss = h.square().mean()
        loss.backward()
        tp[part] = TensorParallelRun(meter.total,
                                     [(e.op, e.sent_bytes) for e in comm.ledger if e.kind == "activations"])
    for ac in (None, {"partition_activations": True, "cpu_checkpointing": True,   # (b) stage 3
                      "contiguous_memory_optimization": True, "number_checkpoints": 2}):
        checkpointing.configure(None)
        cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}
        if ac:
            cfg["activation_checkpointing"] = ac
        engine, *_ = zeroedu.initialize(model=TinyGPT(TinyGPTConfig(checkpoint_activations=True)), config=cfg)
        losses = []
        for step in range(2):
            x, y = shard_batch(*gpt_batch(step, 8), rank, world)
            with engine.track_memory():
                loss = gpt_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
            losses.append(loss.detach())
        s3[ac is not None] = Stage3Run(losses, engine.last_activations.under("blocks.0"), checkpointing.stats(),
                                       [(e.op, e.sent_bytes) for e in engine.ledger if e.kind == "activations"])
    checkpointing.configure(None)
    return ZeroR(tp[False], tp[True], s3[False], s3[True])


def bucket_bytes(rank: int, world: int, layers: tuple[int, ...] = (2, 8), fixed: int = 20_000) -> dict:
    """C_B, measured: TinyGPT with `layers` blocks trained one step at stage 2 with `reduce_bucket_size` = `fixed`
    elements and without it (zeroedu then sizes the bucket to the model, stages/sizing.py). Returns
    {(n_layer, "fixed" | "default"): BucketRun(parameters, bucket_elements, bucket_bytes_high)}, the last the most
    bytes of bucket buffers alive at once on this rank."""
    from zeroedu.models import TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss, shard_batch

    out = {}
    for n_layer in layers:
        cfg_model = TinyGPTConfig(n_layer=n_layer)
        for name, size in (("fixed", fixed), ("default", None)):
            # overlap_comm off: one bucket buffer alive at a time, so the high-water mark does not depend on timing
            zero = {"stage": 2, "overlap_comm": False, **({} if size is None else {"reduce_bucket_size": size})}
            engine, *_ = zeroedu.initialize(model=TinyGPT(cfg_model), config={
                "train_micro_batch_size_per_gpu": 2, "zero_optimization": zero})
            x, y = shard_batch(*gpt_batch(0, 2 * world, cfg_model), rank, world)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
            out[(n_layer, name)] = BucketRun(engine.layout.numel, engine.bucket_numel, engine.bucket_bytes_high)
    return out


def nb11_ranks(rank: int, world: int) -> dict:
    """Notebook 11's one launch: starting ranks is the slow part on 2 cores."""
    return {"zero_r": zero_r(rank, world), "buckets": bucket_bytes(rank, world)}


# -- notebook 12: FSDP2's collectives, counted like zeroedu's ledger ------------------------------------------

_C10D = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_": "reduce_scatter", "allreduce_": "all_reduce"}


@dataclass(frozen=True)
class Collective:
    """One collective a rank ran outside zeroedu's comm layer, with the fields zeroedu.zeropp.where_bytes_go
    reads from a LedgerEntry."""
    op: str
    group: tuple[int, ...]
    tensor_bytes: int        # all-reduce: the tensor; reduce-scatter: its input; all-gather: its output
    sent_bytes: int          # what this rank sends in a ring over the group: theory.ring_sent_bytes
    kind: str = "params"
    step: int = 0

    @property
    def group_size(self) -> int:
        return len(self.group)


def _pg_ranks(arg) -> tuple[int, ...] | None:
    import torch.distributed as dist

    try:
        pg = dist.ProcessGroup.unbox(arg)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return tuple(dist.get_process_group_ranks(pg))


def counted_collectives():
    """A TorchDispatchMode that records every c10d collective run inside it (FSDP2 calls torch.distributed
    directly): op, process group, tensor bytes and ring bytes sent, in `.entries` (Collective rows). It sees the
    same calls torch's CommDebugMode counts, and adds their sizes and groups."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zeroedu import theory

    class _Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.entries: list[Collective] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if func.namespace == "c10d" and name in _C10D:
                op = _C10D[name]
                group = next((g for g in map(_pg_ranks, args) if g is not None), ())
                tensors = [t for a in args for t in (a if isinstance(a, list | tuple) else [a])
                           if isinstance(t, torch.Tensor)]
                sizes = [t.numel() * t.element_size() for t in tensors]
                nbytes = sizes[0] if op == "all_reduce" else max(sizes)
                self.entries.append(Collective(op, group, nbytes,
                                               int(theory.ring_sent_bytes(op, nbytes, len(group)))))
            return func(*args, **(kwargs or {}))

    return _Counter()


def summarize(entries) -> dict:
    """Collectives by op, and the bytes this rank sent."""
    return {"counts": dict(sorted(Counter(e.op for e in entries).items())), "sent": sum(e.sent_bytes for e in entries)}


def _fsdp2(mesh, reshard: bool, sizes):
    from torch.distributed.fsdp import fully_shard

    from zeroedu.models import MLP

    model = MLP(sizes)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _zero_config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0, **zero}}


def _zeroedu_step(engine, x, y, loss_fn) -> None:
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def fsdp2_side_by_side(rank: int, world: int, sizes: tuple[int, ...] = (32, 256, 256, 10)) -> dict:
    """The same MLP (each Linear its own unit) under FSDP2 (reshard_after_forward True and False, a 1-D mesh)
    and under zeroedu's stages 3 and 2 (buckets of one layer, no prefetch), Adam in fp32. Per rank, after a
    first step: the live tensor bytes between forward and backward ("after_forward": what a rank holds while
    the activations wait for backward), then a whole step's collectives by op, bytes sent, live bytes after
    it and at its peak (torch's MemTracker, as zeroedu.bench measures its peers), and the model states."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroedu.bench.pairs import live_bytes, peer_owned
    from zeroedu.memory import MODEL_STATES, resident
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    units = [a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
    mesh = init_device_mesh("cpu", (world,))
    batches = [shard_batch(*mlp_batch(s, 8, sizes), rank, world) for s in range(3)]
    runs = {}
    for reshard in (True, False):
        model, opt = _fsdp2(mesh, reshard, sizes)

        def rest(loss, opt=opt):
            loss.backward()
            opt.step()
            opt.zero_grad()

        runs[f"FSDP2 reshard_after_forward={reshard}"] = (
            lambda x, y, model=model: mlp_loss(model(x), y), rest, [model, opt],
            lambda model=model, opt=opt: peer_owned(model, opt), counted_collectives, lambda c: c.entries)
    for stage in (3, 2):
        engine, *_ = zeroedu.initialize(model=MLP(sizes), config=_zero_config(stage, reduce_bucket_size=max(units)))

        def rest(loss, engine=engine):
            engine.backward(loss)
            engine.step()

        runs[f"zeroedu stage {stage}"] = (
            lambda x, y, engine=engine: mlp_loss(engine(x), y), rest, [engine.module, engine.optimizer],
            engine.owned, lambda engine=engine: _LedgerSince(engine.ledger), lambda c: c.rows())
    out = {"psi": sum(units), "units": units}
    for name, (fwd, rest, external, owned, counter, entries) in runs.items():
        rest(fwd(*batches[0]))                     # the optimizer's state exists from the first step on
        kept: list = []
        after_forward, _ = live_bytes(_forward_into(kept, fwd), batches[1], external, owned())
        rest(kept.pop())
        with counter() as comm:
            after, peak = live_bytes(_whole_step(fwd, rest), batches[2], external, owned())
        states = sum(resident({c: owned().get(c, []) for c in MODEL_STATES}).values())
        out[name] = {**summarize(entries(comm)), "after_forward": after_forward, "resident": after, "peak": peak,
                     "states": states}
    return out


def _forward_into(kept: list, fwd):
    return lambda x, y: kept.append(fwd(x, y))


def _whole_step(fwd, rest):
    return lambda x, y: rest(fwd(x, y))


class _LedgerSince:
    """The entries a zeroedu ledger gains inside a with block (params and grads), like counted_collectives."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger

    def __enter__(self):
        self.first = len(self.ledger)
        return self

    def __exit__(self, *exc) -> None:
        self.last = len(self.ledger)

    def rows(self) -> list:
        return [e for e in self.ledger[self.first:self.last] if e.kind in ("params", "grads")]


def hsdp_vs_hpz(rank: int, world: int, node: int = 2, sizes: tuple[int, ...] = (32, 64, 64, 10)) -> dict:
    """`world` ranks as nodes of `node`. FSDP2's HSDP (a (replicate, shard) mesh of (world // node, node): shard
    inside a node, replicate across nodes) next to zeroedu's stage 3 and hpZ (zero_hpz_partition_size = node),
    the same MLP, the second step of each: this rank's collectives (Collective rows or ledger entries), for
    `node_traffic` to sort into bytes inside and across nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    batches = [shard_batch(*mlp_batch(s, 8, sizes), rank, world) for s in range(2)]
    mesh = init_device_mesh("cpu", (world // node, node), mesh_dim_names=("replicate", "shard"))
    model, opt = _fsdp2(mesh, True, sizes)
    out = {}
    for x, y in batches:
        with counted_collectives() as comm:
            mlp_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["FSDP2 HSDP 2x2"] = comm.entries
    unit = max(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    for name, extra in (("zeroedu stage 3", {}), ("zeroedu hpZ", {"zero_hpz_partition_size": node})):
        engine, *_ = zeroedu.initialize(model=MLP(sizes), config=_zero_config(3, reduce_bucket_size=unit, **extra))
        for x, y in batches:
            first = len(engine.ledger)
            _zeroedu_step(engine, x, y, mlp_loss)
        out[name] = [e for e in engine.ledger[first:] if e.kind in ("params", "grads")]
    return out


def node_traffic(per_rank: list[dict], node: int) -> dict:
    """For each run of `hsdp_vs_hpz`, from every rank's collectives: rank 0's count by op and the bytes a rank
    sends inside its node and to other nodes, averaged over ranks (zeroedu.zeropp.where_bytes_go)."""
    from zeroedu.engine.extras.zeropp import where_bytes_go

    out = {}
    for name in per_rank[0]:
        where = where_bytes_go([r[name] for r in per_rank], node)
        out[name] = {"counts": dict(sorted(Counter(e.op for e in per_rank[0][name]).items())),
                     "intra_node": where["intra_node"], "cross_node": where["cross_node"], "total": where["total"]}
    return out


def capped_training(rank: int, world: int, sizes: tuple[int, ...], cap: int) -> dict:
    """Build MLP(sizes) inside zero.Init under a MemoryCap of `cap` bytes, then train 2 steps at stage 3 with SGD
    (8 bytes of model states per parameter, / world) with the engine's peak tracker on: the cap's per-operator
    bookkeeping is too slow to run the training steps under, so the steps' peak is measured and compared with
    the cap (the same run as tests/test_zero.py's). Building outside Init under the same cap fails."""
    from zeroedu import zero
    from zeroedu.memory import MemoryCap
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    unit = max(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    cfg = {"train_micro_batch_size_per_gpu": 8 // world, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": unit,
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 2 * unit}}
    out = {}
    try:
        with MemoryCap(cap):
            MLP(sizes)
        out["whole"] = "built"
    except torch.OutOfMemoryError as e:
        out["whole"] = str(e).split(": ", 1)[1]
    cap_mode = MemoryCap(cap)
    with cap_mode, zero.Init(config=cfg):
        model = MLP(sizes)
    engine, *_ = zeroedu.initialize(model=model, config=cfg)
    for s in range(2):
        x, y = shard_batch(*mlp_batch(s, 8, sizes), rank, world)
        with engine.track_memory():
            engine.backward(mlp_loss(engine(x), y))
            engine.step()
    out.update(build_peak=cap_mode.peak_total, train_peak=engine.memory()["peak_total"],
               states=sum(engine.memory()["resident"][k] for k in
                          ("parameters", "gradients", "master_weights", "optimizer_state")))
    return out


def nb12_four_ranks(rank: int, world: int, cap_sizes: tuple[int, ...], cap: int) -> dict:
    """Notebook 12's launch of 4 ranks: HSDP next to hpZ, and training under the memory cap."""
    return {"hsdp": hsdp_vs_hpz(rank, world), "cap": capped_training(rank, world, cap_sizes, cap)}


# -- notebook 12: zero.Init, GatheredParameters, the 16-bit save, bytes per parameter ------------------------


@dataclass
class InitRun:
    """MLP(sizes) built on one rank, with or without zero.Init, then trained 3 steps at stage 3."""

    peak: int                     # the construction's peak on this rank (zeroedu.memory.PeakTracker), bytes
    losses: list[torch.Tensor]    # this rank's loss at each step


@dataclass
class InitAndCap:
    """init_and_cap's result on one rank."""

    whole: InitRun                # built the ordinary way: every rank holds the whole model
    inside: InitRun               # built inside zero.Init
    cap: int                      # the MemoryCap: 3/4 of the model's fp32 bytes
    cap_whole: str                # building it whole under the cap: "built", or the OutOfMemoryError's words
    cap_inside: str               # the same inside zero.Init


@dataclass
class InitPeaks:
    """init_peaks' result on one rank: the construction peak of MLP(sizes), in bytes."""

    whole: int
    inside: int


def _build(sizes: tuple[int, ...], cfg: dict, use_init: bool):
    """MLP(sizes) built with or without zero.Init, and the construction's peak bytes on this rank."""
    from zeroedu import zero
    from zeroedu.memory import PeakTracker
    from zeroedu.models import MLP

    with PeakTracker(dict, lambda: "build") as tracker, zero.Init(config=cfg, enabled=use_init):
        model = MLP(sizes)
    return model, tracker.peak_total


def init_peaks(rank: int, world: int, sizes: tuple[int, ...]) -> InitPeaks:
    """Only the construction of MLP(sizes), without and with zero.Init: the peaks (notebook 12's try-it cell)."""
    cfg = _zero_config(3)
    return InitPeaks(_build(sizes, cfg, False)[1], _build(sizes, cfg, True)[1])


def init_and_cap(rank: int, world: int, sizes: tuple[int, ...]) -> InitAndCap:
    """MLP(sizes) built with and without zero.Init, the construction peak measured (zeroedu.memory.PeakTracker),
    then trained 3 steps at stage 3; and built again under a MemoryCap of 3/4 of the model's fp32 bytes."""
    from zeroedu import zero
    from zeroedu.memory import MemoryCap
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    cfg = _zero_config(3, stage3_gather_16bit_weights_on_model_save=True)
    cap = 3 * 4 * sum(p.numel() for p in MLP(sizes).parameters()) // 4
    runs, capped = {}, {}
    for use_init in (False, True):
        model, peak = _build(sizes, cfg, use_init)
        engine, *_ = zeroedu.initialize(model=model, config=cfg)
        losses = []
        for s in range(3):
            x, y = shard_batch(*mlp_batch(s, 8, sizes), rank, world)
            loss = mlp_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        runs[use_init] = InitRun(peak, losses)
        try:
            with MemoryCap(cap), zero.Init(config=cfg, enabled=use_init):
                MLP(sizes)
            capped[use_init] = "built"
        except torch.OutOfMemoryError as e:
            capped[use_init] = str(e).split(": ", 1)[1]
    return InitAndCap(runs[False], runs[True], cap, capped[False], capped[True])


class Read(NamedTuple):
    """What a rank read of the embedding inside GatheredParameters."""

    shape: tuple[int, ...]
    norm: float


def gathered_and_saved(rank: int, world: int, save_dir: str) -> dict:
    """TinyGPT at stage 3 in bf16, one step; then GatheredParameters reads the embedding on every rank and
    changes ln_f on rank 1 only, the ledger rows of both; then save_16bit_model(save_dir)."""
    from zeroedu import zero
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    cfg = {**_zero_config(3, stage3_gather_16bit_weights_on_model_save=True), "bf16": {"enabled": True}}
    engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
    x, y = shard_batch(*gpt_batch(0, 4), rank, world)
    _zeroedu_step(engine, x, y, gpt_loss)
    wte = engine.module.wte.weight
    before = len(engine.ledger)
    with zero.GatheredParameters(wte):                       # read: every rank sees it whole
        read = Read(tuple(wte.shape), float(wte.float().norm()))
    with zero.GatheredParameters(engine.module.ln_f.weight, modifier_rank=1), torch.no_grad():
        if rank == 1:
            engine.module.ln_f.weight.fill_(0.5)             # changed on rank 1 only
    gathers = [(e.op, e.phase, e.tensor_bytes) for e in engine.ledger[before:]]
    saved = engine.save_16bit_model(save_dir)
    return {"empty": wte.numel(), "read": read, "gathers": gathers, "saved": saved,
            "masters": engine.master_state_dict()}


def accum_bytes(rank: int, world: int, stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """TinyGPT in bf16 with gradient accumulation over 2 micro-steps, gradients accumulated in fp32
    (data_types.grad_accum_dtype), at each stage: model-state bytes on this rank after the step (resident)
    and the elements of the model, padded (full) and of this rank's shard."""
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    out = {}
    for stage in stages:
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
               "data_types": {"grad_accum_dtype": "fp32"},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
        for micro in range(2):
            x, y = shard_batch(*gpt_batch(0, 4 * world), rank, world, micro, 2)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
        res = engine.memory()["resident"]
        out[stage] = {**{k: res[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state")},
                      "numel": engine.layout.numel, "full": engine.layout.full_numel,
                      "shard": engine.layout.shard_numel}
    return out


def nb12_two_ranks(rank: int, world: int, sizes: tuple[int, ...], save_dir: str) -> dict:
    """Notebook 12's launch of 2 ranks: sections 1-5."""
    return {"init": init_and_cap(rank, world, sizes), "gathered": gathered_and_saved(rank, world, save_dir),
            "fsdp2": fsdp2_side_by_side(rank, world), "accum": accum_bytes(rank, world)}
