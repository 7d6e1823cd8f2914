"""Stage 3 with data-dependent routing: an expert that runs on one rank and not on the other.

The experts sit in a leaf module (zeroedu.zero.set_z3_leaf_modules, DeepSpeed's API), so every rank gathers the
same units in the same order; the expert no token reached on a rank gets no gradient there and counts as zero,
as in DeepSpeed. The reference is one process on the whole global batch with the same token-by-token routing
(tests/routing_workers.py): the losses and the trained weights must agree with it to float rounding.
"""

from __future__ import annotations

import pytest
import torch

import zeroedu

pytestmark = pytest.mark.timeout(600)

RUNS = {
    "defaults": {},
    "small buckets, overlap, no prefetch": {"reduce_bucket_size": 100, "overlap_comm": True,
                                            "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0},
    "prefetch, reuse": {"stage3_prefetch_bucket_size": 10_000, "stage3_max_reuse_distance": 10_000,
                        "stage3_param_persistence_threshold": 0},
}


@pytest.fixture(scope="module")
def routed():
    from routing_workers import many_routed

    return zeroedu.launch(many_routed, world_size=2, args=(RUNS,), timeout=500)


def test_the_data_route_an_expert_on_one_rank_only(routed):
    """The case under test happens: on some steps expert 1 runs on rank 0 and not on rank 1."""
    for name in RUNS:
        used = [routed[r][name]["expert1_used"] for r in range(2)]
        assert any(a and not b for a, b in zip(*used, strict=True)), (name, used)


@pytest.mark.parametrize("name", list(RUNS))
def test_stage3_with_a_leaf_matches_one_process(routed, name):
    from routing_workers import BATCH, STEPS, reference

    ref_losses, ref_params = reference(STEPS, BATCH)
    for r in range(2):
        out = routed[r][name]
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        for n, ref in ref_params.items():
            err = float((out["params"][n] - ref).norm() / ref.norm())
            assert err < 1e-6, (name, n, err)


def test_a_leaf_class_absent_from_the_model_is_refused():
    with pytest.raises(ValueError, match="no module of class Bilinear"):
        zeroedu.zero.set_z3_leaf_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)), [torch.nn.Bilinear])
