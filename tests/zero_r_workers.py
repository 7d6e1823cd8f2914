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
