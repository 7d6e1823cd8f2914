"""Functions that run inside launched ranks for the ZeRO-R tests (activations, checkpointing, zero.Init)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroedu
from zeroedu import checkpointing
from zeroedu.comm import Comm
from zeroedu.memory import SavedActivations
from zeroedu.models import TensorParallelMLP, TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss, shard_batch

from workers import config


def gpt_run(rank: int, world: int, stage: int, precision: str = "fp32", model: dict | None = None,
            ac: dict | None = None, seq: int = 32, steps: int = 3, global_batch: int = 8, **zero) -> dict:
    """TinyGPT (model: TinyGPTConfig fields) trained at `stage` on sequences of `seq` tokens; the second step's
    memory is tracked. Returns the global-batch losses, the weights, the activations and what checkpointing
    moved."""
    cfg = config(stage, precision, micro=global_batch // world, **zero)
    if ac is not None:
        cfg["activation_checkpointing"] = ac
    checkpointing.configure(None)   # process-wide, as in DeepSpeed: the section (if any) sets it again
    engine, *_ = zeroedu.initialize(model=TinyGPT(TinyGPTConfig(**(model or {}))), config=cfg)
    losses = []
    for step in range(steps):
        x, y = shard_batch(*gpt_batch(step, global_batch), rank, world)
        with engine.track_memory() if step == 1 else nullcontext():
            loss = gpt_loss(engine(x[:, :seq]), y[:, :seq])
            engine.backward(loss)
            engine.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)        # outside the engine: not in its ledger
        losses.append(float(total) / world)
    mem = engine.memory()
    return {
        "losses": losses,
        "params": engine.master_state_dict(),
        "activations": mem["activations"],
        "blocks": [engine.last_activations.under(f"blocks.{i}") for i in range(len(engine.module.blocks))],
        "moved": [(e.op, e.phase, e.sent_bytes) for e in engine.ledger if e.kind == checkpointing.KIND],
        "stats": checkpointing.stats(),
    }


def gpt_runs(rank: int, world: int, runs: list[tuple[str, dict]]) -> dict:
    """Several gpt_run in one launch (starting ranks is the slow part on 2 cores)."""
    return {key: gpt_run(rank, world, **kw) for key, kw in runs}


def tp_mlp_run(rank: int, world: int, layers: int, d_model: int, tokens: int, ac: dict | None) -> dict:
    """`layers` tensor-parallel MLPs with residuals over all ranks (tensor parallelism, no data parallelism);
    each layer checkpointed if `ac` is given. Returns the loss, the input's gradient, this rank's parameter
    gradients, the activation bytes this rank kept and the checkpointing ledger."""
    comm = Comm()
    mlps = [TensorParallelMLP(d_model, comm, seed=i) for i in range(layers)]
    if ac is not None:
        checkpointing.configure({"activation_checkpointing": ac}, tp_comm=comm)
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(5)).requires_grad_()
    with SavedActivations(exclude=[p for m in mlps for p in m.parameters()]) as meter:
        h = x
        for m in mlps:
            h = h + (checkpointing.checkpoint(m, h) if ac is not None else m(h))
        loss = F.mse_loss(h, torch.zeros_like(h))
    saved = meter.total
    loss.backward()
    return {
        "loss": float(loss.detach()), "x_grad": x.grad, "saved": saved,
        "grads": [p.grad for m in mlps for p in m.parameters()],
        "moved": [(e.op, e.phase, e.kind, e.tensor_bytes, e.sent_bytes) for e in comm.ledger
                  if e.kind == checkpointing.KIND],
    }


def _mlp_config(stage: int = 3, micro: int = 4, optimizer: str = "Adam", **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def init_run(rank: int, world: int, sizes: tuple[int, ...], use_init: bool, steps: int = 3) -> dict:
    """MLP(sizes) built with or without zero.Init (construction peak measured), trained at stage 3."""
    from zeroedu import zero
    from zeroedu.memory import PeakTracker
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    cfg = _mlp_config()
    with PeakTracker(dict, lambda: "init") as tracker:
        with zero.Init(config=cfg, enabled=use_init):
            model = MLP(sizes)
    empty = [p.numel() for p in model.parameters()]
    engine, *_ = zeroedu.initialize(model=model, config=cfg)
    losses = []
    for s in range(steps):
        x, y = shard_batch(*mlp_batch(s, 8, sizes), rank, world)
        loss = mlp_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"peak": tracker.peak_total, "empty": empty, "losses": losses, "params": engine.master_state_dict()}


def capped_run(rank: int, world: int, sizes: tuple[int, ...], cap: int, use_init: bool) -> dict:
    """Build MLP(sizes) under a MemoryCap of `cap` bytes, then train 2 steps at stage 3 with SGD, the engine's
    peak tracked (the cap's per-operator bookkeeping is too slow to run a training step under); report how
    it ended."""
    from zeroedu import zero
    from zeroedu.memory import MemoryCap
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    unit = max(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=False))
    cfg = _mlp_config(optimizer="SGD", reduce_bucket_size=unit, stage3_prefetch_bucket_size=0,
                      stage3_max_live_parameters=2 * unit)
    cap_mode = MemoryCap(cap)
    try:
        with cap_mode, zero.Init(config=cfg, enabled=use_init):
            model = MLP(sizes)
    except torch.OutOfMemoryError as e:
        return {"ok": False, "error": str(e), "peak": cap_mode.peak_total}
    engine, *_ = zeroedu.initialize(model=model, config=cfg)
    for s in range(2):
        x, y = shard_batch(*mlp_batch(s, 8, sizes), rank, world)
        with engine.track_memory():
            loss = mlp_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    return {"ok": True, "peak": cap_mode.peak_total, "train_peak": engine.memory()["peak_total"],
            "loss": float(loss.detach())}


def gathered_run(rank: int, world: int) -> dict:
    """GatheredParameters on Init's pieces (initialise a layer after construction, copy a weight) and on a
    stage-3 engine's units (read the embedding, modify on rank 1); what every rank then sees."""
    from zeroedu import zero
    from zeroedu.models import MLP, TinyGPT

    out: dict = {}
    cfg = _mlp_config()
    with zero.Init(config=cfg):
        mlp = MLP((8, 16, 16, 4))
    first, second = mlp.layers[0], mlp.layers[1]
    with zero.GatheredParameters(first.weight, modifier_rank=0):
        if rank == 0:                          # only rank 0 draws: the others get its values
            torch.manual_seed(123)
            torch.nn.init.normal_(first.weight, std=0.5)
    with zero.GatheredParameters([*second.parameters(), mlp.layers[2].weight], modifier_rank=1), torch.no_grad():
        if rank == 1:                          # copy a weight: layer 2's rows from layer 1's first rows
            mlp.layers[2].weight.copy_(second.weight[:4])
    with zero.GatheredParameters(mlp.parameters()):
        out["init_full"] = {n: p.detach().clone() for n, p in mlp.named_parameters()}
    out["init_empty"] = all(p.numel() == 0 for p in mlp.parameters())

    engine, *_ = zeroedu.initialize(model=TinyGPT(), config=_mlp_config(micro=2))
    gathers_before = len(engine.ledger.select(phase=zero.PHASE, op="all_gather"))
    wte = engine.module.wte.weight
    out["wte_empty_before"] = wte.numel()
    with zero.GatheredParameters(wte):
        out["wte"] = wte.detach().clone()
    out["wte_empty_after"] = wte.numel()
    with zero.GatheredParameters(engine.module.ln_f.parameters(), modifier_rank=1), torch.no_grad():
        if rank == 1:
            engine.module.ln_f.weight.fill_(0.5)
    out["master"] = engine.master_state_dict()
    out["gathers"] = [(e.op, e.kind, e.tensor_bytes, e.sent_bytes) for e in engine.ledger.select(phase=zero.PHASE)
                      ][gathers_before:]
    unit = engine.layout.buckets[engine._bucket_of[engine.module.ln_f.weight].index]
    out["ln_f_piece"] = engine.layout.piece_of_shard(engine.param_shard, unit).clone()
    out["ln_f_unit"] = (unit.padded, unit.piece)
    out["refused"] = []     # an engine whose extras keep more copies of the parameters: modifier_rank refused
    for extra in ({"zero_quantized_weights": True}, {"offload_optimizer": {"device": "cpu"}}):
        other, *_ = zeroedu.initialize(model=TinyGPT(), config=_mlp_config(micro=2, **extra))
        try:
            with zero.GatheredParameters(other.module.ln_f.parameters(), modifier_rank=0):
                pass
            out["refused"].append(None)
        except RuntimeError as e:
            out["refused"].append((type(other).__name__, str(e)))
    return out


def save16_run(rank: int, world: int, stage: int, path: str, gather_flag: bool) -> dict:
    """TinyGPT in bf16 trained 2 steps at `stage`, then save_16bit_model(path)."""
    from zeroedu.models import gpt_batch, gpt_loss, shard_batch

    cfg = _mlp_config(stage=stage, micro=2, stage3_gather_16bit_weights_on_model_save=gather_flag)
    cfg["bf16"] = {"enabled": True}
    engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
    for s in range(2):
        x, y = shard_batch(*gpt_batch(s, 4), rank, world)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
    saved = engine.save_16bit_model(path)
    return {"saved": saved, "master": engine.master_state_dict()}


def accum_run(rank: int, world: int, stage: int, accum_dtype: str | None, steps: int = 2) -> dict:
    """TinyGPT in bf16, 2 micro-steps per step, gradients accumulated in `accum_dtype` (None: the default)."""
    from workers import run_steps

    cfg = config(stage, "bf16", accum=2, micro=2)
    if accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": accum_dtype}
    engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
    losses = run_steps(engine, "gpt", rank, world, steps)
    return {"losses": losses, "params": engine.master_state_dict(), "resident": engine.memory()["resident"],
            "psi": engine.layout.numel, "full": engine.layout.full_numel, "shard": engine.layout.shard_numel}
