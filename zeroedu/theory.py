"""Closed forms, in bytes: model-state memory per rank and communication per step for ZeRO stages 0-3.

Psi = parameters, N = data-parallel ranks. zeroedu cuts its flat buffers into buckets (stages 0-2: greedy
buckets of reduce_bucket_size elements; stage 3: one per module "unit") and pads each bucket to a multiple
of N, so the exact numbers take a `layout` (the buckets' element counts); `layout=None` means one bucket
of Psi. The ZeRO paper (Rajbhandari et al., 2020) ignores padding: `model_state_bytes_paper` is its form.
"""

from __future__ import annotations

import math

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def padded_numel(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) * world_size


def layout_numel(layout: list[int], world_size: int) -> int:
    return sum(padded_numel(n, world_size) for n in layout)


def param_bytes(precision: str) -> int:
    return PARAM_BYTES[precision]


def master_bytes(precision: str) -> int:
    """fp32 master weights: none in fp32 training (the parameters are the master), else 4 bytes."""
    return 0 if precision == "fp32" else 4


def optimizer_state_bytes(optimizer: str = "adam", momentum: float = 0.0) -> int:
    """Adam/AdamW: momentum + variance in fp32 (8). SGD: 4 with momentum, else 0."""
    optimizer = optimizer.lower()
    if optimizer in {"adam", "adamw"}:
        return 8
    if optimizer == "sgd":
        return 4 if momentum > 0 else 0
    raise ValueError(f"unknown optimizer {optimizer!r}: use adam, adamw or sgd")


def model_state_bytes(psi: int, world_size: int, stage: int, precision: str = "bf16", optimizer: str = "adam",
                      momentum: float = 0.0, layout: list[int] | None = None) -> dict[str, int]:
    """Bytes per rank of parameters, gradients, fp32 master weights and optimizer state."""
    n = world_size
    full = layout_numel(layout or [psi], n)
    shard = full // n
    p, m, o = param_bytes(precision), master_bytes(precision), optimizer_state_bytes(optimizer, momentum)
    out = {
        "parameters": p * (shard if stage >= 3 else full),
        "gradients": p * (shard if stage >= 2 else full),
        "master_weights": m * (shard if stage >= 1 else full),
        "optimizer_state": o * (shard if stage >= 1 else full),
    }
    out["total"] = sum(out.values())
    return out


def model_state_bytes_paper(psi: float, world_size: int, stage: int, k: int = 12) -> float:
    """The paper's Table 1 form for mixed-precision Adam: 2 Psi + 2 Psi + K Psi, partitioned by stage."""
    n = world_size
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]


def ring_sent_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends under the ring algorithm for a tensor of `nbytes` (the full tensor)."""
    n = world_size
    if n == 1:
        return 0
    steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[op]
    return steps * nbytes // n


def comm_bytes_per_step(psi: int, world_size: int, stage: int, precision: str = "bf16", grad_accum: int = 1,
                        layout: list[int] | None = None, persistent: list[int] | None = None) -> dict[str, int]:
    """Bytes each rank sends per optimizer step, as "phase/op" -> bytes, plus "total".

    Collectives run in the compute dtype on padded buckets. Stage 0 all-reduces gradients once per step,
    stage 1 reduce-scatters them once per step, stage 2 at every micro-step (a shard cannot hold the sum of
    full gradients); stages 1-2 all-gather updated parameters after the step. Stage 3 gathers every
    non-persistent unit in forward and again in backward and reduce-scatters every unit, per micro-step;
    persistent units are gathered once after the step. Scalars (the gradient norm) are not included.
    """
    n, p = world_size, param_bytes(precision)
    layout = layout or [psi]
    persistent = list(persistent or [])
    rest = list(layout)
    for u in persistent:
        rest.remove(u)

    def vol(op: str, sizes: list[int]) -> int:
        return sum(ring_sent_bytes(op, padded_numel(s, n) * p, n) for s in sizes)

    out: dict[str, int] = {}
    if stage == 0:
        out["backward/all_reduce"] = vol("all_reduce", layout)
    elif stage in (1, 2):
        out["backward/reduce_scatter"] = vol("reduce_scatter", layout) * (grad_accum if stage == 2 else 1)
        out["step/all_gather"] = vol("all_gather", layout)
    else:
        out["forward/all_gather"] = vol("all_gather", rest) * grad_accum
        out["backward/all_gather"] = vol("all_gather", rest) * grad_accum
        out["backward/reduce_scatter"] = vol("reduce_scatter", layout) * grad_accum
        if persistent:
            out["step/all_gather"] = vol("all_gather", persistent)
    out["total"] = sum(out.values())
    return out


def comm_volume_paper(stage: int) -> int:
    """Per-step volume in units of Psi (paper): all-reduce = reduce-scatter + all-gather = 2 Psi; stage 3
    adds a second all-gather (forward and backward) = 3 Psi."""
    return 3 if stage == 3 else 2


def collective_time(op: str, nbytes: int, world_size: int, alpha_s: float, beta_bytes_per_s: float) -> float:
    """Alpha-beta model of a ring collective: ring steps x latency + bytes sent / bandwidth."""
    n = world_size
    steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[op]
    return steps * alpha_s + ring_sent_bytes(op, nbytes, n) / beta_bytes_per_s


def fit_alpha_beta(samples: list[tuple[str, int, int, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) from measured (op, nbytes, world_size, seconds) samples."""
    import numpy as np

    a = []
    for op, nbytes, n, _ in samples:
        steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[op]
        a.append([steps, ring_sent_bytes(op, nbytes, n)])
    t = np.array([s[3] for s in samples])
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(a, dtype=float), t, rcond=None)
    return float(alpha), float(1.0 / inv_beta)
