"""zeroedu.course.holdings: what each rank holds at each moment of a step, read off live engines on 2 and 4 gloo
ranks at stages 0-3, against zeroedu.theory's closed forms and the model's own parameter counts."""

from __future__ import annotations

import math

import matplotlib
import pytest

from zeroedu import course, theory
from zeroedu.course import holdings as hd
from zeroedu.theory.vocab import MODEL_STATES

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(400)


def _configs(n: int) -> dict:
    # stage 3 with threshold 0: no unit is kept whole, so parameters are exactly the 1/N shard
    return {s: course.ds_config(s, "bf16", world_size=n, **({"stage3_param_persistence_threshold": 0} if s == 3
                                                           else {})) for s in range(4)}


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return request.param, hd.holdings_run(_configs(request.param), world_size=request.param)


def test_after_the_optimizer_step_each_rank_holds_the_closed_form(run):
    n, h = run
    for stage in range(4):
        layout = h.layouts[stage]
        want = theory.model_state_bytes(sum(layout), n, stage, "bf16", layout=layout)
        for fr in h.at(stage, hd.AFTER_STEP):
            kept = fr.bytes_by_category(temporary=False)
            assert {c: kept.get(c, 0) for c in MODEL_STATES} == {c: want[c] for c in MODEL_STATES}, (stage, fr.rank)
        for fr in h.at(stage, hd.END):     # the step is over: nothing temporary is left
            assert fr.bytes_by_category(temporary=True) == {}
            assert sum(fr.bytes_by_category().get(c, 0) for c in MODEL_STATES) == want["total"]


def test_pieces_say_which_part_of_the_layout(run):
    n, h = run
    for stage in range(4):
        for fr in h.at(stage, hd.AFTER_STEP):
            master = [x for x in fr.holdings if x.category == "master_weights"]
            assert all(x.dtype == "float32" for x in master)
            params = [x for x in fr.holdings if x.category == "parameters"]
            assert [(x.piece, x.dtype) for x in params] == [
                ("whole" if stage < 3 else f"piece {fr.rank} of {n}", "bfloat16")]
            if stage == 0:
                assert [x.piece for x in master] == ["whole"]
            else:   # this rank's 1/N: one flat shard, or one piece per bucket
                assert all(x.piece.endswith(f"piece {fr.rank} of {n}") for x in master)


def test_stage3_after_forward_of_unit_k_holds_unit_k_gathered_in_bf16(run):
    n, h = run
    units = h.units[3]["units"]              # (module name, its parameters, elements) from the engine's units
    for frames in h.frames[3]:
        seen = 0
        for fr in frames:
            if not fr.moment.startswith("after forward of unit "):
                continue
            k = int(fr.moment.rsplit(" ", 1)[1])
            mine = [x for x in fr.holdings if x.piece == f"unit {k}, whole"]
            padded = math.ceil(units[k][2] / n) * n
            assert [(x.category, x.dtype, x.numel, x.nbytes, x.temporary) for x in mine] == [
                ("gathered_parameters", "bfloat16", padded, 2 * padded, True)], fr.moment
            seen += 1
        assert seen == len(units) - 1        # every unit but the root, which is "after forward"


def test_backward_holds_bucket_buffers_only_while_it_reduces(run):
    _, h = run
    for stage in (2, 3):
        for frames in h.frames[stage]:
            during = [f for f in frames if f.moment.startswith("backward: ")]
            assert during and all(f.bytes_by_category(temporary=True).get("buckets", 0) > 0 for f in during)
            after = next(f for f in frames if f.moment == hd.AFTER_REDUCE)
            assert "buckets" not in after.bytes_by_category()
    # stage 0 keeps its flat gradient for good: nothing is temporary at any moment
    assert all(f.bytes_by_category(temporary=True) == {} for frames in h.frames[0] for f in frames)


def test_figure_puts_stages_side_by_side(run):
    n, h = run
    fig = hd.figure({f"stage {s}": h.at(s, "backward: unit 1" if s == 3 else "backward: bucket 1") for s in range(4)})
    axes = fig.axes
    assert len(axes) == 4
    assert all(len(ax.get_yticks()) == n for ax in axes)
    # rank 0 on top in every panel, whatever the number of panels (shared y: inverted once)
    assert all(ax.yaxis_inverted() for ax in axes)
    assert all(hd.figure({f"stage {s}": h.at(s, hd.AFTER_STEP) for s in range(k)}).axes[0].yaxis_inverted()
               for k in (1, 2, 3))
    hatched = [p for ax in axes[2:] for p in ax.patches if p.get_hatch()]
    assert hatched and not [p for p in axes[0].patches if p.get_hatch()]


def test_a_moment_not_recorded_is_named(run):
    _, h = run
    with pytest.raises(KeyError, match="no frame 'after lunch'.*after forward"):
        h.at(0, "after lunch")


def test_rows_strip_and_stepper(run):
    n, h = run
    frames = h.frames[2]
    fr = h.at(2, hd.AFTER_STEP)[0]
    table = hd.rows(fr)
    assert sum(r[4] for r in table) == sum(x.nbytes for x in fr.holdings)
    assert ["parameters", "parameters", "whole", "bfloat16", 2 * sum(h.layouts[2]), False] in table
    fig = hd.strip(frames)
    assert [ax.get_title() for ax in fig.axes] == ["after forward", "backward: bucket 3", hd.AFTER_REDUCE,
                                                   hd.AFTER_STEP, hd.END]
    with pytest.raises(KeyError, match="no frame 'x'"):
        hd.strip(frames, ["x"])
    stepper = hd.Stepper(frames, "stage 2")
    assert stepper.moments == hd.moments(frames[0]) and stepper.png.startswith(b"\x89PNG")
    stepper.slider.value = hd.AFTER_STEP                      # moving the slider redraws
    assert repr(stepper).startswith(f"rank 0, {hd.AFTER_STEP}:") and "master weights" in repr(stepper)
    bundle = stepper._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["text/plain"] == repr(stepper) and data["image/png"]   # what a saved notebook keeps


def test_figures_speak_chinese_under_zh(run):
    from zeroedu import i18n
    from zeroedu.i18n import figures

    _, h = run
    before = i18n.current()
    i18n.lang("zh")
    try:
        for fig in (hd.strip(h.frames[3]), hd.figure({"stage 2": h.at(2, "backward: bucket 1")})):
            assert figures.untranslated(fig) == []
            assert any("临时" in t.get_text() for t in figures._texts(fig))
    finally:
        i18n.lang(before)


@pytest.fixture(scope="module")
def extras():
    cfgs = {"offload": course.ds_config(2, "bf16", world_size=2, offload_optimizer={"device": "cpu"}),
            "zeropp": course.ds_config(3, "bf16", world_size=2, zero_hpz_partition_size=2,
                                       stage3_param_persistence_threshold=0)}
    return hd.holdings_run(cfgs, world_size=2)


def test_offload_holdings_name_the_host(extras):
    layout = extras.layouts["offload"]
    want = theory.model_state_bytes(sum(layout), 2, 2, "bf16", layout=layout)
    for fr in extras.at("offload", hd.AFTER_STEP):
        device = fr.bytes_by_category()
        assert "master_weights" not in device and "optimizer_state" not in device
        host = fr.tiers["host"]
        assert host["master_weights"] == want["master_weights"] and host["optimizer_state"] == want["optimizer_state"]
        assert ["optimizer state", "on the host", "-", "-", want["optimizer_state"], False] in hd.rows(fr)
    fig = hd.figure({"offload": extras.at("offload", hd.AFTER_STEP)})
    assert any(t.get_text().endswith("MB on the host") for t in fig.axes[0].texts)
    from zeroedu import i18n
    from zeroedu.i18n import figures

    before = i18n.current()
    i18n.lang("zh")
    try:
        fig = hd.figure({"stage 2, offload_optimizer cpu": extras.at("offload", hd.AFTER_STEP)})
        assert figures.untranslated(fig) == []
    finally:
        i18n.lang(before)


def test_zeropp_keeps_a_secondary_copy_of_the_parameters(extras):
    layout = extras.layouts["zeropp"]
    want = theory.model_state_bytes(sum(layout), 2, 3, "bf16", layout=layout)
    for fr in extras.at("zeropp", hd.AFTER_STEP):
        params = [x for x in fr.holdings if x.category == "parameters"]
        # hpZ: the primary 1/N shard plus the secondary partition over the hpZ group (2 ranks here: also 1/2)
        assert len(params) == 2 and sum(x.nbytes for x in params) == 2 * want["parameters"]
        assert all(x.dtype == "bfloat16" for x in params)


def test_hpz_secondary_copy_is_named_and_the_step_ledgers_come_back(extras):
    """hpZ's second, node-local partition is a buffer of its own ("hpZ secondary copy", the rank's piece of its
    node), of theory's hpz_secondary_bytes; holdings_run returns every rank's ledger of the watched step, whose
    bytes are theory.zeropp_comm_bytes'; the figure of notebook 09 speaks Chinese under zh."""
    from zeroedu import i18n, zeropp
    from zeroedu.i18n import figures

    layout = extras.layouts["zeropp"]
    want = theory.zeropp_comm_bytes(sum(layout), 2, 2, precision="bf16", layout=layout, hpz=True)
    for fr in extras.at("zeropp", hd.AFTER_STEP):
        secondary = [(x.piece, x.nbytes) for x in fr.holdings if x.buffer == "hpZ secondary copy"]
        assert secondary == [(f"piece {fr.rank} of 2 (node 0)", want["hpz_secondary_bytes"])]
    assert len(extras.ledgers["zeropp"]) == 2 and all(e.step == 1 for e in extras.ledgers["zeropp"][0])
    got = zeropp.where_bytes_go(extras.ledgers["zeropp"], 2)
    assert all(got[k] == want[k] for k in ("intra_node", "cross_node", "cross_node_per_node"))
    before = i18n.current()
    i18n.lang("zh")
    try:
        # the panels' names are the runs' (notebook 09's "hpZ", "ZeRO++" stay English, as the terms do)
        fig = hd.figure({"stage 3": extras.at("zeropp", hd.AFTER_STEP)},
                        title="Who holds what with hpZ")
        assert figures.untranslated(fig) == []
    finally:
        i18n.lang(before)
