"""A model whose experts are chosen token by token (as a mixture of experts routes), so that on some steps an
expert runs on one rank and not on another; and a single-process reference with the same routing.

Nothing here imports the engine outside the rank function: the reference is plain torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LR = 1e-3
VOCAB, WIDTH = 13, 8


class Experts(nn.Module):
    """Two experts; token t goes to expert 1 when t < 4, else to expert 0. An expert no token is routed to is not
    called at all, so its parameters get no gradient on that rank."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        route = (idx < 4).long()
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out = out.index_put((mask,), expert(h[mask]))
        return out


class Routed(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.moe = Experts()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(self.emb(idx)))
        return self.head(h + self.moe(h, idx))


def routed_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of `batch` samples of 5 tokens. On even steps the second half has no token below 4: with
    2 ranks, expert 1 runs on rank 0 only."""
    g = torch.Generator().manual_seed(31 + step)
    x = torch.randint(0, VOCAB, (batch, 5), generator=g)
    if step % 2 == 0:
        x[batch // 2:] = 4 + x[batch // 2:] % (VOCAB - 4)
    x[0, 0] = 1   # rank 0 always routes a token to expert 1
    return x, (x * 5 + 2) % VOCAB


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference(steps: int, global_batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trains on the whole global batch (every token routed as on the ranks); a parameter that got
    no gradient steps with a zero gradient, as Adam on a ZeRO shard does."""
    m = Routed()
    params = dict(m.named_parameters())
    opt = torch.optim.Adam(params.values(), lr=LR)
    losses = []
    for s in range(steps):
        x, y = routed_batch(s, global_batch)
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(m(x), y)
        loss.backward()
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in params.items()}


def train_routed(rank: int, world: int, stage: int, steps: int, global_batch: int, leaf: bool, zero: dict) -> dict:
    import torch.distributed as dist

    import zeroedu
    from zeroedu.models import shard_batch

    model = Routed()
    if leaf:
        zeroedu.zero.set_z3_leaf_modules(model, [Experts])
    cfg = {"train_micro_batch_size_per_gpu": global_batch // world, "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, **zero}}
    engine, *_ = zeroedu.initialize(model=model, config=cfg)
    losses, used = [], []
    for s in range(steps):
        x, y = shard_batch(*routed_batch(s, global_batch), rank, world)
        used.append(bool((x < 4).any()))
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "params": engine.master_state_dict(), "expert1_used": used}


def many_routed(rank: int, world: int, runs: dict[str, dict]) -> dict:
    """Several stage-3 trainings of Routed (its experts a leaf) in one launch: name -> zero_optimization keys."""
    return {name: train_routed(rank, world, 3, STEPS, BATCH, True, zero) for name, zero in runs.items()}


STEPS, BATCH = 4, 8
