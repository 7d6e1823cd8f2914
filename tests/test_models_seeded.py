"""A model built from a seed has the same weights whatever other threads do. `zeroedu grade --jobs 2` grades two
notebooks in threads of one process, and each computes its single-process reference by building the model from
its seed: with the global generator shared and unguarded, the two builds interleaved their draws and an honest
learner lost 4 of 11 points on exercise 4 in CI ("the gradient ... is away from the gradient of the whole batch").
Real threads, switching every microsecond; each build compared with the same build done alone."""

from __future__ import annotations

import sys
import threading

import torch

from zeroedu.models import MLP, Quirky, TensorParallelMLP, TinyGPT, seeded


def _weights(build) -> dict[str, torch.Tensor]:
    built = build()
    modules = built if isinstance(built, tuple) else (built,)   # TensorParallelMLP.full: the two whole Linears
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(modules) for k, v in m.state_dict().items()}


BUILDS = {"TinyGPT": TinyGPT, "MLP": MLP, "Quirky": Quirky, "TP full": lambda: TensorParallelMLP.full(16)}


def test_models_built_in_threads_at_once_equal_the_ones_built_alone():
    alone = {name: _weights(build) for name, build in BUILDS.items()}
    wrong: list[str] = []
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as the interpreter allows
    try:
        def work(name):
            for _ in range(15):
                got = _weights(BUILDS[name])
                if any(not torch.equal(got[k], alone[name][k]) for k in got):
                    wrong.append(name)
        threads = [threading.Thread(target=work, args=(name,)) for name in [*BUILDS, *BUILDS]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert wrong == []


def test_seeded_is_torch_manual_seed_for_the_block():
    with seeded(3):
        a = torch.randn(4)
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(4))
