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


def test_tour_caption_says_why_stage_0_has_no_activations():
    """The figure's caption names the reason only when the bars show it: stage 0 peaks in the optimizer step with
    (almost) no activations while the sharded stages peak in backward; otherwise it says what to see in general."""
    def row(stage: int, phase: str, activations: int) -> dict:
        return {"stage": stage, "peak_phase": phase,
                "peak_by_category": {"parameters": 1000, "activations": activations}}

    rows = [row(0, "step", 8), *(row(s, "backward", 900) for s in (1, 2, 3))]
    assert tour.caption(rows).startswith("Stage 0's bar has almost no activations: it peaks in Adam's")
    assert tour.caption([row(0, "step", 0), *rows[1:]]).startswith("Stage 0's bar has no activations")
    other = tour.caption([row(0, "backward", 900), *rows[1:]])
    assert other.startswith("Each bar:") and "activations do not" in other


def test_bench_runs_every_stage_against_its_peer():
    """`zeroedu bench` on a tiny workload: every pair runs, timed rounds are paired, zeroedu's model states
    and ledger bytes per step equal theory (the times themselves are not checked: they belong to benchmarks)."""
    from zeroedu import bench, theory
    from zeroedu.bench import pairs
    from zeroedu.models import TinyGPT

    rows = bench.run(world_size=2, d_model=32, layers=1, rounds=2, warmup=1, micro_batch=2,
                     zero={"stage3_param_persistence_threshold": 0})
    assert [(r["stage"], r["peer"].split()[0]) for r in rows] == [
        (0, "DDP"), (1, "ZeroRedundancyOptimizer"), (2, "FSDP2"), (3, "FSDP2")]
    sizes = [p.numel() for p in dict.fromkeys(TinyGPT(pairs.workload_config(32, 1), seed=0).parameters())]
    psi = sum(sizes)
    assert all(n % 2 == 0 for n in sizes)   # no padding at N = 2, whatever the buckets
    for r in rows:
        assert r["rounds"] == 2 and r["zeroedu_ms"] > 0 and r["peer_ms"] > 0 and r["ratio"] > 0
        assert r["zeroedu_states"] == r["theory_states"], r
        assert r["sent_per_step"] == theory.comm_bytes_per_step(psi, 2, r["stage"], "fp32")["total"], r
        # The limit: compute and the replayed transfer of the stage's own collectives, both measured
        assert r["compute_ms"] > 0 and r["transfer_ms"] > 0 and r["vs_limit"][0] > 0, r
    assert "| 3 | FSDP2 reshard_after_forward=True |" in bench.format_rows(rows, 2, 32, 1)
