"""Functions that run inside launched ranks for the graduation tests: the same script under zeroedu and DeepSpeed."""

from __future__ import annotations

import importlib
import time

import torch

from zeroedu.models import MLP, shard_batch


def quiet_deepspeed():
    """Import DeepSpeed for CPU ranks over gloo. Its shared-memory all-reduce op (a C++ extension compiled on first
    use, minutes here) serves only inference all-reduces, so it is not built (zeroedu.graduate does the same)."""
    from zeroedu.graduate import import_deepspeed

    return import_deepspeed()


def lr_trace(rank: int, world: int, runs: list[tuple[str, str, dict, int]]) -> dict:
    """For each (key, "zeroedu"|"deepspeed", config, steps): the batch sizes the engine derived and its lr after
    initialize and after every optimizer step; or the error initialize raised (type and message)."""
    out = {}
    for key, name, cfg, steps in runs:
        ds = quiet_deepspeed() if name == "deepspeed" else importlib.import_module("zeroedu")
        model = MLP(seed=0)
        t0 = time.time()
        try:
            engine, *_ = ds.initialize(model=model, config=cfg)
        except Exception as e:   # both libraries must refuse the same configs
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        lrs = [engine.get_lr()[0]]
        for s in range(steps):
            x = torch.randn(micro * accum * world, 32, generator=torch.Generator().manual_seed(s))
            y = torch.randint(0, 10, (micro * accum * world,), generator=torch.Generator().manual_seed(s))
            for m in range(accum):
                xs, ys = shard_batch(x, y, rank, world, m, accum)
                loss = torch.nn.functional.cross_entropy(engine(xs).float(), ys)
                engine.backward(loss)
                engine.step()
            lrs.append(engine.get_lr()[0])
        out[key + "/seconds"] = time.time() - t0
        out[key] = {"micro": micro, "accum": accum, "train_batch_size": engine.train_batch_size(), "lrs": lrs}
    return out
