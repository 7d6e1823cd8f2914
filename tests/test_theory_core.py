"""zeroedu.theory against the ZeRO paper's numbers and against formulas written out here."""

from __future__ import annotations

import pytest

from zeroedu import theory


def test_paper_figure_1():
    """Rajbhandari et al. 2020, Figure 1: 7.5B parameters on 64 GPUs, K = 12 -> 120, 31.4, 16.6, 1.9 GB."""
    got = [round(theory.model_state_bytes_paper(7.5e9, 64, s) / 1e9, 1) for s in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]
    # The exact form agrees with the paper when nothing needs padding.
    exact = [theory.model_state_bytes(7_500_000_000, 64, s, "fp16")["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in exact] == got


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_padding_each_bucket(n):
    layout = [7, 10, 1]
    padded = sum(-(-b // n) * n for b in layout)
    assert theory.layout_numel(layout, n) == padded
    m = theory.model_state_bytes(18, n, 3, "bf16", layout=layout)
    assert m == {"parameters": 2 * padded // n, "gradients": 2 * padded // n, "master_weights": 4 * padded // n,
                 "optimizer_state": 8 * padded // n, "total": 16 * padded // n}


def test_fp32_has_no_separate_master_and_sgd_state():
    m = theory.model_state_bytes(100, 4, 0, "fp32", "sgd", momentum=0.9)
    assert m == {"parameters": 400, "gradients": 400, "master_weights": 0, "optimizer_state": 400, "total": 1200}


def test_ring_bytes():
    assert theory.ring_sent_bytes("all_reduce", 1200, 4) == 2 * 3 * 300
    assert theory.ring_sent_bytes("reduce_scatter", 1200, 4) == 900
    assert theory.ring_sent_bytes("all_gather", 1200, 1) == 0


def test_comm_per_step_by_stage():
    psi, n = 1000, 4                # bf16: 2000 bytes
    s = [theory.comm_bytes_per_step(psi, n, st, "bf16", grad_accum=2) for st in range(4)]
    assert s[0] == {"backward/all_reduce": 3000, "total": 3000}
    assert s[1] == {"backward/reduce_scatter": 1500, "step/all_gather": 1500, "total": 3000}
    assert s[2]["backward/reduce_scatter"] == 2 * 1500   # every micro-step
    assert s[3] == {"forward/all_gather": 3000, "backward/all_gather": 3000, "backward/reduce_scatter": 3000,
                    "total": 9000}
    p = theory.comm_bytes_per_step(30, 2, 3, "fp32", layout=[10, 20], persistent=[10])
    assert p["forward/all_gather"] == 40 and p["step/all_gather"] == 20
    assert [theory.comm_volume_paper(st) for st in range(4)] == [2, 2, 2, 3]


def test_alpha_beta_fit_recovers_known_values():
    alpha, beta = 5e-5, 2e9
    samples = [(op, nb, n, theory.collective_time(op, nb, n, alpha, beta))
               for op in ("all_reduce", "all_gather") for nb in (1 << 10, 1 << 20, 1 << 26) for n in (2, 4)]
    a, b = theory.fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
