"""Notebook 18, the estimator audit: memory estimates next to the bytes measured per category, same model, same stage.

`measure(rank, world, save_dir)` trains TinyGPT (bf16, Adam) on every rank: real DeepSpeed 0.19.8 and zeroedu at
stage 2, each at DeepSpeed's default reduce_bucket_size (5e8 elements) and at a bucket sized to the model, and
zeroedu at stage 3 with DeepSpeed's stage-3 sizes and with units released after each use. zeroedu's meter
(zeroedu.memory) measures both libraries the same way: the resident bytes after a step and the peak of the last
step, by category (zeroedu.graduate.train does it on DeepSpeed's own tensors).

`estimates(psi, largest_layer, world)` returns every estimate of a rank's bytes on the device the notebook
audits, each computed by its own author's code or rule: DeepSpeed's `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs` (called, not copied), the 16-bytes-per-parameter rule and "x4 the fp32
weights", and zeroedu.theory's paper formula.
"""

from __future__ import annotations

import os

DS_BUCKET = 500_000_000
SMALL_BUCKET = 30_000


def _config(stage: int, bucket: int, **zero) -> dict:
    # torch_adam: DeepSpeed steps torch's AdamW (weight decay 0: Adam's update) instead of building FusedAdam
    return {"train_batch_size": 8, "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, **zero}}


def measure(rank: int, world: int, save_dir: str) -> dict:
    """Resident and peak bytes by category for each run on this rank (see the module's docstring)."""
    from zeroedu.course.casebook import DS_LIVE, DS_PERSIST, DS_PREFETCH, DS_REUSE, run_case
    from zeroedu.graduate import train

    out = {}
    for name in ("deepspeed", "zeroedu"):
        for bucket in (DS_BUCKET, SMALL_BUCKET):
            r = train(rank, world, name, _config(2, bucket), 2, os.path.join(save_dir, f"{name}-{bucket}"))
            out[name, 2, bucket] = {"resident": r["model_states"], "peak": r["peak"], "peak_total": r["peak_total"]}
    for key, zero in {"ds-sizes": {"stage3_prefetch_bucket_size": DS_PREFETCH, "stage3_max_live_parameters": DS_LIVE,
                                   "stage3_max_reuse_distance": DS_REUSE,
                                   "stage3_param_persistence_threshold": DS_PERSIST},
                      "released": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}}.items():
        cfg = _config(3, DS_BUCKET if key == "ds-sizes" else SMALL_BUCKET, **zero)
        r = run_case(rank, world, cfg)
        out["zeroedu", 3, key] = {"resident": r["resident"], "peak": r["peak"], "peak_total": r["peak_total"]}
    return out


def estimates(psi: int, largest_layer: int, world: int) -> dict[str, dict[int, float]]:
    """Device bytes per rank that each estimate gives for stages 2 and 3 (no offload), by estimate's name."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from zeroedu import theory

    ds2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=world, cpu_offload=False)[1]
    ds3 = estimate_zero3_model_states_mem_needs(psi, largest_layer, num_gpus_per_node=world, cpu_offload=False,
                                                cpu_offload_params=False)[1]
    return {
        "16 bytes per parameter": {2: 16 * psi, 3: 16 * psi},
        "x4 the fp32 weights": {2: 4 * 4 * psi, 3: 4 * 4 * psi},
        "DeepSpeed estimate_zero*_model_states_mem_needs": {2: ds2, 3: ds3},
        "DeepSpeed's zero2 estimate before PR #5099 (4 + 16/N)": {2: 4 * psi + 16 * psi // world},
        "zeroedu.theory (the paper's 2 + 14/N, 16/N)": {s: theory.model_state_bytes_paper(psi, world, s)
                                                        for s in (2, 3)},
    }
