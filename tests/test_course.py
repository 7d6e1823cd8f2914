"""zeroedu.course, the notebooks' harness: each helper against an independent reference (the papers' printed
numbers, closed forms written here, or a real launch)."""

from __future__ import annotations

import math

import pytest

import zeroedu
from zeroedu import course, theory
from zeroedu.config import load_config


# =============================================================================================================
# 13_choosing and 15_interview
# =============================================================================================================
def test_markdown_table_escapes_pipes_and_keeps_shape():
    text = course.markdown_table([["a|b", 1], ["line\nbreak", 2.5]], ["x", "y"])
    lines = text.splitlines()
    assert lines[0] == "| x | y |" and lines[1] == "|---|---|"
    assert lines[2] == "| a\\|b | 1 |" and lines[3] == "| line break | 2.5 |"


def test_verdicts_record_filter_and_count():
    v = course.Verdicts()
    v.add("A.1", "intro", "claim one", "wrong", "because 1.5x")
    v.add("A.2", "stage 1", "claim two", "right", "measured")
    with pytest.raises(ValueError, match="grade must be one of"):
        v.add("A.2", "stage 1", "claim three", "mostly right", "")
    assert v.counts() == {"right": 1, "partly right": 0, "wrong": 1}
    only = v.table("A.2")
    assert "claim two" in only and "claim one" not in only and "| 2 | stage 1 |" in only   # numbered overall
    assert v.summary().count("\n") == 3


def test_paper_example_is_figure_1():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters on 64 GPUs, mixed-precision Adam
    got = course.paper_example(7.5e9, 64)
    assert [round(got[s], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


def test_cheat_sheet_rows_follow_the_closed_forms():
    n = 64
    rows = course.cheat_sheet_rows(7.5e9, n, measured={s: (3 if s == 3 else 2, 2) for s in range(4)})
    per_param = [16, 4 + 12 / n, 2 + 14 / n, 16 / n]
    for s, row in enumerate(rows):
        assert row[0] == f"ZeRO-{s}"
        assert row[2].endswith(f"= {per_param[s]:.3g} B/param")
        assert row[3] == f"{7.5 * per_param[s]:.1f} GB"
        assert row[4] == ("3Ψ" if s == 3 else "2Ψ")
        assert row[5] == ("1.50x" if s == 3 else "1.00x")


def test_interview_config_splits_the_global_batch():
    cfg = course.interview_config(2, 4, accum=2, offload=True)
    assert cfg["train_micro_batch_size_per_gpu"] * 4 * cfg["gradient_accumulation_steps"] == 16
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert "offload_param" not in cfg["zero_optimization"]
    assert load_config(course.interview_config(3, 2, offload=True, offload_param=True)).stage == 3


def test_korthikanti_activations():
    # Korthikanti et al. 2022, Sec. 4: sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: all of it / t
    s, b, h, a, t = 2048, 1, 4096, 32, 8
    full = s * b * h * (34 + 5 * a * s / h)
    assert course.korthikanti_activation_bytes(s, b, h, a) == full
    assert math.isclose(course.korthikanti_activation_bytes(s, b, h, a, t=t),
                        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert math.isclose(course.korthikanti_activation_bytes(s, b, h, a, t=t, sequence_parallel=True), full / t)


def test_cpu_adam_rate_is_a_rate():
    rate = course.cpu_adam_rate(numel=100_000, repeats=1)
    assert math.isfinite(rate) and rate > 0


def test_slowest_rank_counts():
    ranks = [{"samples": [("all_reduce", 8, 2, 0.5), ("all_gather", 8, 2, 0.1)]},
             {"samples": [("all_reduce", 8, 2, 0.2), ("all_gather", 8, 2, 0.3)]}]
    assert course.slowest_rank_samples(ranks) == [("all_reduce", 8, 2, 0.5), ("all_gather", 8, 2, 0.3)]


def _one_step_ledgers(rank: int, world_size: int) -> dict:
    steps, psi = course.ledger_of_one_step(rank, world_size, d_model=32, n_layer=1)
    samples = course.time_ring_collectives(sizes=(4096,), tries=1)
    return {"sent": {s: sum(r["sent_bytes"] for r in rows) for s, rows in steps.items()}, "psi": psi,
            "samples": samples}


@pytest.mark.timeout(300)
def test_ledger_of_one_step_and_the_timed_collectives_on_two_ranks():
    [r0, r1] = zeroedu.launch(_one_step_ledgers, world_size=2, backend="gloo")
    psi = r0["psi"]
    assert psi < 100_000                      # one bucket at stages 0-2
    for s in (0, 1, 2):
        assert r0["sent"][s] == theory.comm_bytes_per_step(psi, 2, s, "bf16")["total"], s
    assert r0["sent"][3] >= 1.5 * r0["sent"][2] * (1 - 1e-3)   # stage 3 units are padded one by one
    assert [x[:3] for x in r0["samples"]] == [(op, 4096, 2) for op in ("all_reduce", "reduce_scatter", "all_gather")]
    assert all(x[3] > 0 for x in r0["samples"] + r1["samples"])
