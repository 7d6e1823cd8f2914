"""zeroedu.course, the notebooks' harness: real ranks, real gloo, against one process with torch's own Adam
and against the closed forms of zeroedu.theory (worked out by hand in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

import zeroedu
from zeroedu import course, theory
from zeroedu.config import load_config

pytestmark = pytest.mark.timeout(300)


# ---- notebooks 00-04 (course part A) -------------------------------------------------------------------------

def test_ds_config_splits_the_global_batch_and_names_bad_input():
    cfg = course.ds_config(stage=1, precision="bf16", world_size=4, grad_accum=2)
    assert cfg["train_micro_batch_size_per_gpu"] == 1        # 8 = 4 ranks x 2 micro-steps x 1
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 20_000, "overlap_comm": True}
    # written out even at 0: DeepSpeed 0.19.8 clips at 1.0 when the key is left out (GRADIENT_CLIPPING_DEFAULT)
    assert cfg["gradient_clipping"] == 0.0 and course.ds_config(clip=1.0)["gradient_clipping"] == 1.0
    zeroedu.load_config(cfg)                                 # a config zeroedu accepts
    with pytest.raises(ValueError, match="does not split into 3 ranks"):
        course.ds_config(world_size=3)
    with pytest.raises(ValueError, match="precision must be"):
        course.ds_config(precision="fp64")


def test_local_engine_holds_16_bytes_per_parameter():
    for precision, master in (("fp32", 0), ("bf16", 4)):
        engine = course.local_engine(precision, micro_batch=2)
        course.one_step(engine, 0, 2)                          # Adam makes its state at the first step
        psi = sum(p.numel() for p in engine.params)
        mem = course.model_states(engine.memory()["resident"])
        p = 4 if precision == "fp32" else 2
        assert mem == {"parameters": p * psi, "gradients": p * psi, "master_weights": master * psi,
                       "optimizer_state": 8 * psi}
        assert sum(mem.values()) == 16 * psi


def _runs(world: int) -> dict:
    return {
        "s0": (course.ds_config(0, world_size=world), {"state": True, "timeline": True}),
        "s0_clip": (course.ds_config(0, world_size=world, clip=0.05), {}),
        "s1": (course.ds_config(1, world_size=world), {"state": True}),
        "s1_clip": (course.ds_config(1, world_size=world, clip=0.05), {"state": True}),
        "s1_fp16": (course.ds_config(1, "fp16", world_size=world), {}),
        "s1_bf16": (course.ds_config(1, "bf16", world_size=world), {"track_step": 2}),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return zeroedu.launch(course.run_many, world_size=2, backend="gloo", args=(_runs(2),), timeout=240)


def test_train_matches_one_process_with_torch_adam(two_ranks):
    ref_losses, ref_state = course.reference(steps=course.STEPS)
    clip_losses, clip_state = course.reference(steps=course.STEPS, clip=0.05)
    for rank in (0, 1):
        for name, (losses, state) in {"s0": (ref_losses, ref_state), "s1": (ref_losses, ref_state),
                                      "s1_clip": (clip_losses, clip_state)}.items():
            got = two_ranks[rank][name]
            assert got["losses"] == pytest.approx(losses, rel=1e-6), (rank, name)
            assert course.max_rel_diff(got["state"], state) < 1e-5, (rank, name)
    # clipping at 0.05 changes the training, so the comparison above can tell the two apart
    assert course.max_rel_diff(clip_state, ref_state) > 1e-4


def test_summary_bytes_equal_the_closed_forms(two_ranks):
    r0 = two_ranks[0]
    psi, layout = r0["s0"]["psi"], r0["s0"]["layout"]
    assert psi == 109_952 and sum(layout) == psi
    for name, stage, precision in (("s0", 0, "fp32"), ("s1", 1, "fp32"), ("s1_bf16", 1, "bf16")):
        got = r0[name]
        assert got["per_step"] == theory.comm_bytes_per_step(psi, 2, stage, precision, layout=layout)
        want = theory.model_state_bytes(psi, 2, stage, precision, layout=layout)
        assert course.model_states(got["memory"]) == {c: want[c] for c in theory.MODEL_STATES}
        assert got["model_states"] == want["total"]
    # by hand: stage 0 in fp32 all-reduces 4 bytes x psi, a ring sends 2(N-1)/N of it = 1x at N = 2
    assert r0["s0"]["per_step"]["total"] == 4 * psi
    # stage 1, bf16, N = 2: 2 + 2 + 12 / 2 = 10 bytes per parameter (psi is even: no padding)
    assert r0["s1_bf16"]["model_states"] == 10 * psi
    assert r0["s1_bf16"]["peak"] is not None and r0["s1_bf16"]["peak_phase"] in {"forward", "backward", "step"}


def test_gradient_norm_all_reduce_only_with_clipping_or_fp16(two_ranks):
    """Notebooks 03 and 04 say so: a sharded stage all-reduces one scalar (the global gradient norm) when
    clipping or fp16's overflow check needs it, and not otherwise; stage 0 never (every rank has the norm)."""
    for r in two_ranks:
        assert r["s0"]["scalar_all_reduces"] == r["s0_clip"]["scalar_all_reduces"] == 0
        assert r["s1"]["scalar_all_reduces"] == 0
        assert r["s1_bf16"]["scalar_all_reduces"] == 0
        assert r["s1_clip"]["scalar_all_reduces"] == 1
        assert r["s1_fp16"]["scalar_all_reduces"] == 1
        scalars = [e for e in r["s1_clip"]["entries"] if e[2] == "scalar"]
        assert scalars == [("all_reduce", "step", "scalar", 1, 4)]   # one fp32 number, 2(N-1)/N x 4 bytes


def test_timeline_of_the_last_step(two_ranks):
    r = two_ranks[1]["s0"]
    tl = r["timeline"]
    assert tl["rank"] == 1 and [p for p, *_ in tl["compute"]] == ["forward", "backward", "step"]
    # only the last step's collectives: one all-reduce per bucket
    assert [c[0] for c in tl["comm"]] == ["all_reduce"] * len(r["layout"])
    assert set(r["phases"]) == {"forward", "backward", "step"} and all(v > 0 for v in r["phases"].values())


def test_per_rank_and_state_helpers():
    results = [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert course.per_rank(results, "a") == [1, 3]
    ref = {"w": torch.tensor([3.0, 4.0]), "steps": torch.tensor([1])}
    assert course.max_rel_diff({"w": torch.tensor([3.0, 4.0])}, ref) == 0.0
    assert course.max_rel_diff({"w": torch.tensor([3.0, 5.0])}, ref) == pytest.approx(1 / 5)
    assert course.rel_weight_diff({"w": torch.tensor([0.0, 4.0])}, {"w": torch.tensor([3.0, 4.0])}) == \
        pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="share no floating-point tensor"):
        course.max_rel_diff({}, ref)


def test_compare_rows_and_markdown_table():
    rows = course.compare_rows("stage 1", {"a": 2, "b": 5}, {"a": 2, "b": 4, "total": 6})
    assert rows == [["stage 1", "a", 2, 2, True], ["stage 1", "b", 5, 4, False], ["stage 1", "= total", 7, 6, False]]
    md = course.markdown_table([["x|y", 1234567, True]], ["name", "bytes", "ok"])
    assert md.splitlines() == ["| name | bytes | ok |", "|---|---|---|", "| x\\|y | 1,234,567 | True |"]
    with pytest.raises(ValueError, match="a row has 2 cells, the headers 3"):
        course.markdown_table([[1, 2]], ["a", "b", "c"])


def test_min_time_and_show(capsys):
    calls = []
    t = course.min_time(lambda: calls.append(1), repeats=4, barrier=False)
    assert len(calls) == 4 and 0 <= t < 1
    assert course.show("stage 1 sends **1.00x**") is None
    assert "stage 1 sends **1.00x**" in capsys.readouterr().out     # no IPython shell here: printed


# ---- notebooks 05_stage2, 06_stage3, 07_scaling, 08_offload, 09_zeropp, 10_checkpoints (course part B) --------

def test_stage1_peak_holds_the_reduced_gradient_shard(two_ranks):
    """Notebook 07 says so: stage 1 keeps its full 16-bit gradient buffer (2 Psi) at rest, and from the last
    backward to the step also the reduced gradient of its own piece (2 Psi / N), so its peak model states exceed
    the resting ones by exactly that shard; stage 2's gradient shard is persistent, so nothing is added."""
    for r in two_ranks:
        got = r["s1_bf16"]
        psi = got["psi"]                                     # 109,952: even, so no padding at N = 2
        assert got["memory"]["gradients"] == 2 * psi
        assert got["peak_phase"] in ("backward", "step")
        assert got["peak"]["gradients"] == 2 * psi + 2 * psi // 2


def test_bucket_stats_from_a_summary(two_ranks):
    s = two_ranks[0]["s1"]
    stats = course.bucket_stats(s)
    assert stats["buckets"] == len(s["layout"])
    assert stats["reduce_scatters"] == len(s["layout"])      # stage 1: one reduce-scatter per bucket, at the step
    assert stats["largest_bucket"] == max(-(-n // 2) * 2 for n in s["layout"])


def test_stage3_units_cover_every_parameter_once():
    from zeroedu.models import TinyGPT

    engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=course.ds_config(
        3, world_size=1, stage3_param_persistence_threshold=200))
    got = course.stage3_units(engine)
    model = TinyGPT(seed=0)
    params = dict(model.named_parameters())                 # a tied weight is listed once
    assert sum(n for _, _, n in got["units"]) == sum(p.numel() for p in params.values())
    modules = dict(model.named_modules())
    for name, pnames, numel in got["units"]:
        module = modules["" if name == "(the model itself)" else name]
        assert numel == sum(dict(module.named_parameters(recurse=False))[p].numel() for p in pnames)
    # the LayerNorms (weight + bias of width 64) are the units under 200 elements
    assert got["persistent"] == [128] * sum(1 for n in modules if n.endswith(("ln1", "ln2", "ln_f")))
    stage0, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=course.ds_config(0, world_size=1))
    assert course.stage3_units(stage0) is None


def test_paper_table1_by_hand():
    rows = {r[0]: r[1:] for r in course.paper_table1()}
    assert sorted(rows) == [1, 4, 16, 64, 256, 1024]
    # 7.5e9 parameters at N = 64: 16 x 7.5 = 120; (4 + 12/64) x 7.5 = 31.40625; (2 + 14/64) x 7.5 = 16.640625;
    # 16/64 x 7.5 = 1.875 GB, the numbers of the ZeRO paper's Figure 1 and of Table 1's N = 64 row
    assert rows[64] == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    assert rows[1] == pytest.approx([120.0] * 4)
    # the same rows by name (notebook 07): a Table1Row per N, still a tuple for the positional readers above
    at_64 = next(r for r in course.paper_table1() if r.world_size == 64)
    assert isinstance(at_64, course.Table1Row) and (at_64.stage0, at_64.stage3) == pytest.approx((120.0, 1.875))
    assert at_64.by_stage == tuple(at_64[1:]) and [f"{gb:.3g}" for gb in at_64.by_stage] == ["120", "31.4", "16.6",
                                                                                             "1.88"]


def test_scaling_runs_name_each_number():
    """Notebook 07's runs[stage, N]: course.train's per-rank dicts, filed by name (rank 0's bytes, every rank's
    model states, the largest padded bucket), from a hand-made launch result of 2 ranks and 2 stages."""
    def result(rank: int, stage: int) -> dict:
        return {"psi": 10, "layout": [7, 3], "buckets": [(1, 7, 8), (1, 3, 4)],
                "memory": {"parameters": 20 + rank, "gradients": 10, "master_weights": 40, "optimizer_state": 80,
                           "activations": 5},
                "peak": {"parameters": 20, "gradients": 12, "activations": 64}, "peak_phase": "backward",
                "bucket_bytes_high": 16 if stage else None}

    runs = course.scaling_runs({2: [{s: result(rank, s) for s in (0, 2)} for rank in range(2)]})
    assert sorted(runs) == [(0, 2), (2, 2)]
    run = runs[2, 2]
    assert isinstance(run, course.ScalingRun) and (run.stage, run.world_size, run.psi) == (2, 2, 10)
    assert run.model_states == 150 and run.model_states_per_rank == [150, 151]      # activations are not a state
    assert run.peak_model_states == 32 and run.largest_bucket == 8 and run.bucket_bytes_high == 16
    assert run.layout == [7, 3] and run.peak_phase == "backward" and runs[0, 2].bucket_bytes_high is None


def test_cpu_adam_node_seconds_by_hand():
    # 7e9 parameters on 8 GPUs in one node: each rank steps 875M, the node all 7e9; 2 nodes of 8 halve the node's
    t = course.cpu_adam_node_seconds(7e9, 8, 1, params_per_s=1e9)
    assert t == {"shard_params": 875e6, "node_params": 7e9, "node_seconds": 7.0}
    assert course.cpu_adam_node_seconds(7e9, 4, 1, 1e9)["node_seconds"] == 7.0   # fewer GPUs per node: the same
    assert course.cpu_adam_node_seconds(7e9, 8, 2, 1e9)["node_seconds"] == 3.5


def test_offload_config_names_a_missing_nvme_path():
    cfg = course.offload_config(3, "cpu", "cpu")
    zeroedu.load_config(cfg)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    with pytest.raises(ValueError, match="needs nvme_path"):
        course.offload_config(3, "nvme")


def test_offload_runs_take_turns_and_change_no_arithmetic():
    configs = {"stage 2": course.offload_config(2), "stage 2 + opt cpu": course.offload_config(2, "cpu")}
    res = zeroedu.launch(course.offload_runs, world_size=2, backend="gloo", args=(configs, 3), timeout=240)
    for r in res:
        a, b = r["stage 2"], r["stage 2 + opt cpu"]
        assert a["losses"] == b["losses"]                   # fused Adam on the device and on the host: bit for bit
        assert len(a["times"]) == 3 and a["seconds"] > 0
        # by hand: the bf16 gradient shard goes to the host, the new bf16 parameters come back: 2 x Psi/N bytes each
        assert b["moved"] == {"d2h": 2 * b["psi"] // 2, "h2d": 2 * b["psi"] // 2}
        assert a["moved"] == {} and b["adam_seconds"] > 0 and a["adam_seconds"] == 0
        assert set(b["phases"]) == {"forward", "backward", "step"}   # the last step's phases, timed


def test_show_source_shows_the_real_method(capsys):
    from zeroedu.stages.stage2 import Stage2

    text = course.show_source(Stage2.reduce_bucket, Stage2.move_grads)
    assert text.startswith("def reduce_bucket(self, b: Bucket)") and "p.grad = None" in text
    assert "```python" in capsys.readouterr().out


# ---- notebooks 13_choosing and 15_interview (course part C) ----

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
