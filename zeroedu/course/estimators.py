"""Notebook 18, the estimator audit: memory estimates next to the bytes measured per category, same model, same stage.

`measure(rank, world, save_dir)` trains TinyGPT (bf16, Adam) on every rank: real DeepSpeed 0.19.8 and zeroedu at
stage 2, each at DeepSpeed's default reduce_bucket_size (5e8 elements) and at a bucket sized to the model, and
zeroedu at stage 3 with DeepSpeed's stage-3 sizes and with units released after each use. zeroedu's meter
(zeroedu.memory) measures both libraries the same way: the resident bytes after a step and the peak of the last
step, by category (zeroedu.graduate.train does it on DeepSpeed's own tensors), a Measured per run.

`estimates(psi, largest_layer, world)` returns every estimate of a rank's bytes on the device the notebook
audits (an Estimates: `.deepspeed.stage2`, `.paper.stage3`, ...; `.all()` lists them), each computed by its own
author's code or rule: DeepSpeed's `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs` (called, not copied), the 16-bytes-per-parameter rule and "x4 the fp32
weights", and zeroedu.theory's paper formula.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

DS_BUCKET = 500_000_000
SMALL_BUCKET = 30_000


def _config(stage: int, bucket: int, **zero) -> dict:
    # torch_adam: DeepSpeed steps torch's AdamW (weight decay 0: Adam's update) instead of building FusedAdam
    return {"train_batch_size": 8, "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, **zero}}


@dataclass
class Measured:
    """One run's bytes on one rank, by category: resident after a step, and the peak of the last step."""

    resident: dict[str, int]
    peak: dict[str, int]
    peak_total: int

    @property
    def model_states(self) -> int:
        """The resident model states: parameters + gradients + master weights + optimizer state."""
        return sum(self.resident.get(c, 0) for c in ("parameters", "gradients", "master_weights", "optimizer_state"))


@dataclass(frozen=True)
class Estimate:
    """One estimate of a rank's device bytes: its name as the notebook prints it, and its figure per stage."""

    name: str
    stage2: float
    stage3: float | None = None      # None: the estimate has no stage-3 form

    def at(self, stage: int) -> float | None:
        return {2: self.stage2, 3: self.stage3}[stage]


@dataclass(frozen=True)
class Estimates:
    """Every estimate the notebook audits, by a short name; `all()` lists them in the notebook's order."""

    sixteen_per_param: Estimate
    x4_fp32: Estimate
    deepspeed: Estimate
    deepspeed_before_5099: Estimate
    paper: Estimate

    def all(self) -> list[Estimate]:
        return [getattr(self, f.name) for f in fields(self)]


def measure(rank: int, world: int, save_dir: str) -> dict[tuple, Measured]:
    """Resident and peak bytes by category for each run on this rank (see the module's docstring), keyed by
    (library, stage, bucket) at stage 2 and ("zeroedu", 3, "ds-sizes" | "released") at stage 3."""
    from zeroedu.course.casebook import DS_LIVE, DS_PERSIST, DS_PREFETCH, DS_REUSE, run_case
    from zeroedu.graduate import train

    out = {}
    for name in ("deepspeed", "zeroedu"):
        for bucket in (DS_BUCKET, SMALL_BUCKET):
            r = train(rank, world, name, _config(2, bucket), 2, os.path.join(save_dir, f"{name}-{bucket}"))
            out[name, 2, bucket] = Measured(r.model_states, r.peak, r.peak_total)
    for key, zero in {"ds-sizes": {"stage3_prefetch_bucket_size": DS_PREFETCH, "stage3_max_live_parameters": DS_LIVE,
                                   "stage3_max_reuse_distance": DS_REUSE,
                                   "stage3_param_persistence_threshold": DS_PERSIST},
                      "released": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}.items():
        cfg = _config(3, DS_BUCKET if key == "ds-sizes" else SMALL_BUCKET, **zero)
        r = run_case(rank, world, cfg)
        out["zeroedu", 3, key] = Measured(r["resident"], r["peak"], r["peak_total"])
    return out


def estimates(psi: int, largest_layer: int, world: int) -> Estimates:
    """Device bytes per rank that each estimate gives for stages 2 and 3 (no offload)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from zeroedu import theory

    ds2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=world, cpu_offload=False)[1]
    ds3 = estimate_zero3_model_states_mem_needs(psi, largest_layer, num_gpus_per_node=world, cpu_offload=False,
                                                cpu_offload_params=False)[1]
    return Estimates(
        Estimate("16 bytes per parameter", 16 * psi, 16 * psi),
        Estimate("x4 the fp32 weights", 4 * 4 * psi, 4 * 4 * psi),
        Estimate("DeepSpeed estimate_zero*_model_states_mem_needs", ds2, ds3),
        Estimate("DeepSpeed's zero2 estimate before PR #5099 (4 + 16/N)", 4 * psi + 16 * psi // world),
        Estimate("zeroedu.theory (the paper's 2 + 14/N, 16/N)", theory.model_state_bytes_paper(psi, world, 2),
                 theory.model_state_bytes_paper(psi, world, 3)),
    )
