"""course.calibrate_link, the notebooks' path from timed collectives to an alpha-beta link (02 and 13): it must
give the closed-form fit on clean timings and must never raise on the flat, noisy timings of a loaded machine
(where theory.fit_alpha_beta refuses to fit, and a notebook under nbval used to fail with it)."""

import random

import pytest

from zeroedu import course, planner, theory

SIZES = course.RING_SWEEP
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def test_clean_timings_give_the_closed_form_alpha_and_beta():
    alpha, beta = 200e-6, 2e9
    samples = [(op, s, 4, theory.collective_time(op, s, 4, alpha, beta)) for op in OPS for s in SIZES]
    link, note = course.calibrate_link(samples, source="synthetic")
    assert note == ""
    assert link.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert link.beta_bytes_per_s == pytest.approx(beta, rel=1e-9)
    assert link == planner.calibrate(samples, name="this machine", source="synthetic")


def test_flat_noisy_timings_fall_back_to_alpha_zero_and_say_so():
    rng = random.Random(0)
    # a loaded machine: every size takes 10-20 ms, the largest a little less than the smallest
    samples = [(op, s, 4, 0.02 - 0.004 * i / len(SIZES) + rng.uniform(-0.003, 0.003))
               for op in OPS for i, s in enumerate(SIZES)]
    with pytest.raises(ValueError, match="do not grow with bytes"):
        theory.fit_alpha_beta(samples)               # what the notebooks called before
    link, note = course.calibrate_link(samples, source="flat")
    assert link.alpha_s == 0.0
    assert link.beta_bytes_per_s > 0
    assert "alpha = 0" in note and f"{link.beta_bytes_per_s / 1e9:.2f} GB/s" in note
    # beta is the least-squares bandwidth on the relative error: no other beta fits the samples better
    def err(beta):
        return sum((theory.collective_time(op, s, n, 0.0, beta) / t - 1) ** 2 for op, s, n, t in samples)
    assert err(link.beta_bytes_per_s) <= min(err(link.beta_bytes_per_s * f) for f in (0.9, 0.99, 1.01, 1.1))
    assert planner.predict_seconds([("all_reduce", SIZES[-1], 4)], link) > 0


def test_other_errors_still_raise():
    with pytest.raises(ValueError, match="at least two samples"):
        course.calibrate_link([("all_reduce", 1024, 4, 1e-3)])
