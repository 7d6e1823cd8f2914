"""The README's main command: every stage's bytes equal theory, and the plot is written."""

from __future__ import annotations

import pytest

from zeroedu import tour

pytestmark = pytest.mark.timeout(300)


def test_tour_matches_theory(tmp_path):
    rows = tour.run(world_size=2, steps=2, out=tmp_path / "tour.png", progress=False)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        got = {k: v for k, v in r["comm"].items() if v}
        assert got == {k: v for k, v in r["theory_comm"].items() if v}
        for cat in tour.MODEL_STATES:
            assert r["memory"].get(cat, 0) == r["theory_memory"][cat], (r["stage"], cat)
    assert (tmp_path / "tour.png").stat().st_size > 10_000
    assert "stage" in tour.report(rows, 2)
