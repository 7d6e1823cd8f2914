"""Exercise 1's live check: the learner's formula next to what zeroedu's `engine.memory()` measures.

    live = measure_model_states(world_size=2)            # a small MLP, one step at each stage, bf16 + Adam
    check_against_engine(model_state_bytes, live)        # AssertionError naming the first term that differs

The model has 1062 parameters, a multiple of 2, so the engine's flat buffers need no padding and the measured
bytes equal the closed form exactly. Stage 3 keeps no small parameter whole (persistence threshold 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zeroedu.grading.exercises.ranks import run_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr

SIZES = (12, 24, 24, 6)
TERMS = {"parameters": ("parameters",), "gradients": ("gradients",),
         "optimizer_states": ("master_weights", "optimizer_state")}


def _job(rank: int, n: int, precision: str) -> dict:
    import zeroedu
    from zeroedu.models import MLP

    out = {}
    for stage in range(4):
        model = MLP(SIZES, seed=0)
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 10**6,
                                        "stage3_param_persistence_threshold": 0}}
        engine, *_ = zeroedu.initialize(model=model, config=config)
        x = torch.randn(2, SIZES[0], generator=torch.Generator().manual_seed(rank)).to(engine.dtype)
        engine.backward(F.cross_entropy(engine(x).float(), torch.zeros(2, dtype=torch.long)))
        engine.step()
        resident = engine.memory()["resident"]
        out[stage] = {term: sum(int(resident.get(c, 0)) for c in cats) for term, cats in TERMS.items()}
    return out


def _collect(world_size: int, precision: str) -> dict:
    try:
        return {"stages": run_on_ranks(_job, world_size, args=(precision,), what=tr("the engine", "引擎"))[0]}
    except AssertionError as e:
        return {"error": str(e)}


def measure_model_states(world_size: int = 2, precision: str = "bf16") -> dict:
    """{"psi", "world_size", "precision", "stages": {stage: {term: bytes on rank 0}}} from a live engine."""
    live = in_kernel(_collect, world_size, precision)
    if "error" in live:
        raise AssertionError(tr(f"the live engine did not run: {live['error']}",
                                f"真实引擎没有跑起来：{live['error']}"))
    psi = sum(a * b + b for a, b in zip(SIZES, SIZES[1:], strict=False))
    return {"psi": psi, "world_size": world_size, "precision": precision, "stages": live["stages"]}


def table(live: dict) -> str:
    """The live engine's bytes, next to the closed form of exercise 1's table (2, 2, 12 bytes per parameter)."""
    psi, n = live["psi"], live["world_size"]
    lines = [f"Ψ = {psi}, N = {n}, {live['precision']} + Adam: bytes of model states on one rank, engine.memory()"]
    lines.append(f"{'stage':>5} {'parameters':>11} {'gradients':>10} {'optimizer_states':>17}")
    for stage, measured in live["stages"].items():
        lines.append(f"{stage:>5} {measured['parameters']:>11} {measured['gradients']:>10} "
                     f"{measured['optimizer_states']:>17}")
    return "\n".join(lines)


def check_against_engine(model_state_bytes: Callable, live: dict) -> None:
    """Every term of the formula equals the live engine's bytes, at every stage."""
    psi, n, precision = live["psi"], live["world_size"], live["precision"]
    for stage, measured in live["stages"].items():
        mine = model_state_bytes(psi, n, int(stage), precision)
        for term, value in measured.items():
            got = mine.get(term) if isinstance(mine, dict) else None
            if not isinstance(got, int | float) or not abs(got - value) <= 1e-9 * max(1, value):   # NaN fails
                parts = " + ".join(TERMS[term])
                raise AssertionError(tr(
                    f"stage {stage}, Ψ={psi}, N={n}, {precision}: your {term} = {got}, the engine holds {value} "
                    f"bytes of it on each rank (engine.memory(): {parts}).",
                    f"stage {stage}，Ψ={psi}，N={n}，{precision}：你算出的 {term} = {got}，引擎在每个 rank 上"
                    f"实际持有 {value} 字节（engine.memory()：{parts}）。"))
