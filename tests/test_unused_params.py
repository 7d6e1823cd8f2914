"""Parameters used on only some ranks (mixture-of-experts routing, a rank-dependent module) train as a single
process with the same routing does: a missing gradient counts as zero (DeepSpeed's rule at stages 1-3, DDP's
find_unused_parameters), and equal-size buckets are never swapped between ranks.

The probe behind issue 36 found stage 2 wrong by 0.02-0.055 after 1-3 steps: a rank whose expert got no gradient
reduced that expert's bucket after backward, while the other rank reduced it during backward, so two buckets of
equal size met each other's collective and gloo exchanged them without a word.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn

import zeroedu

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LR = 1e-2
STEPS = 4
WORLD = 2
MICRO = 3
EXPERT = 16 * 16 + 16   # one expert's parameters: the bucket size, so each expert is a bucket of its own


class Routed(nn.Module):
    """A trunk, three equal-size experts, a head; `route` picks the expert. A fourth module is used on rank 1
    only (a rank-dependent module)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.extra = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, route: int, extra: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.experts[route](h))
        if extra:
            h = h + self.extra(h)
        return self.out(h)


def route(rank: int, step: int) -> int:
    """Rank 0 and rank 1 use different experts at every step; the third expert goes unused at some steps."""
    return (rank + step) % 3


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * MICRO, 8, generator=g), torch.randn(WORLD * MICRO, 4, generator=g)


def _train(rank: int, world_size: int, stage: int) -> dict[str, torch.Tensor]:
    engine, *_ = zeroedu.initialize(model=Routed(), config={
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": EXPERT,
                              "stage3_param_persistence_threshold": 0}})
    for step in range(STEPS):
        x, y = data(step)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        out = engine(x[mine], route(rank, step), extra=rank == 1)
        engine.backward((out - y[mine]).square().mean())
        engine.step()
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


def reference() -> dict[str, torch.Tensor]:
    """One process, the same routing per rank's share of the batch; the loss is the mean of the ranks' losses (the
    engine averages gradients over ranks), and a parameter without a gradient steps with a zero one."""
    model = Routed()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        for rank in range(WORLD):
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            out = model(x[mine], route(rank, step), extra=rank == 1)
            losses.append((out - y[mine]).square().mean())
        opt.zero_grad(set_to_none=True)
        (sum(losses) / WORLD).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


STAGE3_PENDING = pytest.mark.xfail(strict=True, reason=(
    "stage 3 gathers a unit on the ranks whose forward uses it, so routing that differs between ranks makes their "
    "gathers differ and gloo aborts; marking the routed modules as leaves (zeroedu.zero.set_z3_leaf_modules, as "
    "in DeepSpeed) makes stage 3 train right (tests/test_stage3_routing.py); without it the error is gloo's"))


@pytest.mark.parametrize("stage", [0, 1, 2, pytest.param(3, marks=STAGE3_PENDING)])
def test_parameters_used_on_some_ranks_match_a_single_process(stage):
    ref = reference()
    results = zeroedu.launch(_train, WORLD, args=(stage,), timeout=300)
    for rank, got in enumerate(results):
        assert got.keys() == ref.keys()
        for name in ref:
            err = (got[name] - ref[name]).abs().max().item()
            assert err < 1e-5, f"stage {stage}, rank {rank}, {name}: off by {err}"
