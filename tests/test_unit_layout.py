"""Stage 3's units, written out by hand from first principles and compared with the engine's layout.

A unit is a module that owns trainable parameters directly (a parameter shared by two modules belongs to the first
in model order), padded to a multiple of N so that every rank owns an equal piece. The expected numbers below are
counted from the model's definition, not read from the engine or from zeroedu.theory.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

import zeroedu

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the ranks rebuild the model from this file

N = 3


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))                        # owned by the root itself: 1
        self.emb = nn.Embedding(7, 5)                                   # 7 x 5 = 35
        self.body = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3))     # the Sequential owns nothing itself
        self.out = nn.Linear(3, 7, bias=False)                          # 3 x 7 = 21
        self.head = nn.Linear(5, 7, bias=False)                         # tied to emb: no unit of its own
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.out(self.body(h)) * self.scale + self.head(h)


# (unit, its parameters' sizes in order): root, emb, body.0 (Linear 5 -> 3: 15 + 3), body.1 (LayerNorm(3): 3 + 3), out
UNITS = [("scale", [1]), ("emb", [35]), ("body.0", [15, 3]), ("body.1", [3, 3]), ("out", [21])]
NUMEL = [1, 35, 18, 6, 21]
PADDED = [3, 36, 18, 6, 21]          # each rounded up to a multiple of N = 3
PIECE = [1, 12, 6, 2, 7]             # padded / N: what each rank owns of the unit
START = [0, 3, 39, 57, 63]           # where each unit starts in the full flat buffer (running sum of PADDED)
SHARD_START = [0, 1, 13, 19, 21]     # where each unit's piece starts in a rank's shard (running sum of PIECE)
OFFSETS = [[0], [0], [0, 15], [0, 3], [0]]
FULL, SHARD = 84, 28                 # sum(PADDED), sum(PIECE) = FULL / N


def layout_run(rank: int, world: int) -> dict:
    engine, *_ = zeroedu.initialize(model=Tied(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    layout = engine.layout
    return {"buckets": [(b.numel, b.padded, b.piece, b.start, b.shard_start, b.offsets, [tuple(s) for s in b.shapes])
                        for b in layout.buckets],
            "full": layout.full_numel, "shard": layout.shard_numel,
            "param_bytes": engine.memory()["resident"]["parameters"]}


def test_hand_counted_numbers_add_up():
    assert [sum(sizes) for _, sizes in UNITS] == NUMEL
    assert sum(p.numel() for p in Tied().parameters()) == sum(NUMEL)   # the tied weight counts once


def test_stage3_units_are_the_modules_padded_to_a_multiple_of_n():
    results = zeroedu.launch(layout_run, world_size=N, timeout=240)
    shapes = [[(1,)], [(7, 5)], [(3, 5), (3,)], [(3,), (3,)], [(7, 3)]]
    want = [(n, p, c, s, ss, o, sh) for n, p, c, s, ss, o, sh
            in zip(NUMEL, PADDED, PIECE, START, SHARD_START, OFFSETS, shapes, strict=True)]
    for r in results:   # the same layout on every rank
        assert r["buckets"] == want
        assert (r["full"], r["shard"]) == (FULL, SHARD)
        assert r["param_bytes"] == 4 * SHARD   # fp32: each rank holds its 28-element shard of the parameters
