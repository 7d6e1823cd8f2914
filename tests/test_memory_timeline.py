"""zeroedu.course.memory_timeline: one step's memory on 2 gloo ranks, drawn by PyTorch's own memory viewer code
(torch.cuda._memory_viz, on this CPU-only torch) and checked against the engine's PeakTracker and resident()."""

from __future__ import annotations

import base64
import json
import pickle
import re

import matplotlib
import pytest
from torch.cuda import _memory_viz

from zeroedu import course
from zeroedu.course import memory_timeline as mt
from zeroedu.memory import MODEL_STATES

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(400)

CONFIGS = {2: course.ds_config(2, "bf16", world_size=2),
           3: course.ds_config(3, "bf16", world_size=2, stage3_param_persistence_threshold=0)}


@pytest.fixture(scope="module", params=[2, 3])
def run(request):
    return request.param, mt.timeline_run(CONFIGS[request.param], world_size=2)


def _embedded_snapshot(html: str) -> dict:
    """The snapshot _memory_viz put in its HTML (base64 of a pickle, padded with NULs)."""
    files = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
    return pickle.loads(base64.b64decode(files[0]["base64"]).rstrip(b"\x00"))


def test_torch_memory_viewer_renders_the_snapshot(run):
    _, r = run
    html = _memory_viz.trace_plot(r.snapshot)
    assert "MemoryViz.js" in html and "Active Memory Timeline" in html
    assert "Allocator State History" in _memory_viz.segment_plot(r.snapshot)
    embedded = _embedded_snapshot(html)
    assert embedded == r.snapshot
    for tl in r.timelines:
        allocs = [e for e in embedded["device_traces"][tl.rank] if e["action"] == "alloc"]
        frees = [e for e in embedded["device_traces"][tl.rank] if e["action"] == "free_completed"]
        assert allocs and len(allocs) == sum(1 for e in tl.events if e["action"] == "alloc")
        # every storage made and gone within the step was freed once, and what is left is what the engine holds
        assert len(allocs) - len(frees) == len(tl.after) - len(tl.before) + sum(
            1 for b in tl.before if b["address"] not in {a["address"] for a in tl.after})
    # torch's own text tools read it: one "N entries" per rank, segments that add up (segsum asserts it)
    text = _memory_viz.trace(r.snapshot)
    assert [int(n) for n in re.findall(r"(\d+) entries", text)] == [len(tl.events) for tl in r.timelines]
    assert "segments: 2" in _memory_viz.segsum(r.snapshot)


def test_snapshot_pickle_round_trips(run, tmp_path):
    _, r = run
    path = mt.save_snapshot(r.snapshot, str(tmp_path / "snapshot.pickle"))
    with open(path, "rb") as f:
        assert pickle.load(f) == r.snapshot


def test_peak_equals_the_engines_tracker(run):
    stage, r = run
    for tl, mem in zip(r.timelines, r.memory, strict=True):
        # the engine's PeakTracker watched the same step: same peak, same breakdown, same phase
        assert mt.replay_peak(r.snapshot, tl.rank) == tl.peak == mem["peak_total"]
        phase, by = tl.at_peak()
        assert {k: v for k, v in by.items() if v} == {k: v for k, v in mem["peak"].items() if v}
        assert phase == mem["peak_phase"]
        # after the step: the model states resident() measures from the engine's tensors
        end = tl.samples[-1][2]
        assert {c: end.get(c, 0) for c in MODEL_STATES} == {c: mem["resident"].get(c, 0) for c in MODEL_STATES}
        if stage == 3:   # the forward gathers units (threshold 0) and frees them again
            fwd = [s[2].get("gathered_parameters", 0) for s in tl.samples if s[0] == "forward"]
            assert max(fwd) > 0 and fwd[-1] < max(fwd)


def test_plot_has_a_line_per_category_per_rank(run):
    _, r = run
    fig = mt.plot(r.timelines)
    assert len(fig.axes) == 2
    for ax, tl in zip(fig.axes, r.timelines, strict=True):
        cats = {c for _, _, by in tl.samples for c, v in by.items() if v}
        assert {line.get_label() for line in ax.get_lines()} == {c.replace("_", " ") for c in cats}


def test_a_step_not_run_is_named():
    with pytest.raises(ValueError, match="track_step=5 is not one of the 2 steps"):
        mt.timeline_run(course.ds_config(0, world_size=1), world_size=1, steps=2, track_step=5)


def test_plot_speaks_chinese_under_zh(run):
    from zeroedu import i18n
    from zeroedu.i18n import figures

    _, r = run
    before = i18n.current()
    i18n.lang("zh")
    try:
        fig = mt.plot(r.timelines)
        assert figures.untranslated(fig) == []
        assert "一步之内各类别的存活字节数" in [t.get_text() for t in figures._texts(fig)]
    finally:
        i18n.lang(before)
