"""zeroedu.viz draws what it is given: bar heights, theory markers, timeline boxes and curves are checked
against the input numbers (and, for the alpha-beta lines, against the closed form written out here)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import zeroedu  # noqa: E402
from zeroedu import viz  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KiB = 1024


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def bars_by_label(ax) -> dict[str, list[tuple[float, float]]]:
    """{legend label: [(bottom, height) per bar]} from the axes' bar containers."""
    return {c.get_label(): [(r.get_y(), r.get_height()) for r in c.patches]
            for c in ax.containers if isinstance(c, BarContainer)}


def theory_lines(ax) -> list[float]:
    return [line.get_ydata()[0] for line in ax.get_lines() if line.get_gid() == "theory"]


def test_memory_bars_stack_categories_in_order_with_theory_markers():
    per_bar = {
        "stage 0": {"parameters": 4 * KiB, "gradients": 4 * KiB, "optimizer_state": 8 * KiB, "buckets": 0},
        "stage 1": {"parameters": 4 * KiB, "gradients": 4 * KiB, "optimizer_state": 2 * KiB, "activations": KiB},
    }
    fig = viz.memory_bars(per_bar, theory={"stage 0": 16 * KiB, "stage 1": 10 * KiB}, unit="KiB")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    bars = bars_by_label(ax)
    # buckets are zero everywhere: no segment; the rest stack in CATEGORIES order
    assert list(bars) == ["parameters", "gradients", "optimizer state", "activations"]
    assert bars["parameters"] == [(0, 4), (0, 4)]
    assert bars["gradients"] == [(4, 4), (4, 4)]
    assert bars["optimizer state"] == [(8, 8), (8, 2)]
    assert bars["activations"] == [(16, 0), (10, 1)]
    assert theory_lines(ax) == [16, 10]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["stage 0", "stage 1"]
    # one colour per category, the same in every notebook
    colors = {c.get_label(): c.patches[0].get_facecolor() for c in ax.containers if isinstance(c, BarContainer)}
    assert colors["parameters"] == matplotlib.colors.to_rgba(viz.CATEGORY_COLORS["parameters"])
    assert colors["optimizer state"] == matplotlib.colors.to_rgba(viz.CATEGORY_COLORS["optimizer_state"])
    assert "KiB" in ax.get_ylabel()


def test_memory_bars_picks_a_unit_and_skips_missing_theory():
    fig = viz.memory_bars({"a": {"parameters": 3 * 2**20}, "b": {"parameters": 2**20}}, theory={"a": 3 * 2**20})
    ax = fig.axes[0]
    assert "MiB" in ax.get_ylabel()
    assert bars_by_label(ax)["parameters"] == [(0, 3), (0, 1)]
    assert theory_lines(ax) == [3]
    with pytest.raises(ValueError, match="nothing to draw"):
        viz.memory_bars({})


def test_ledger_bars_stack_phase_ops_and_ignore_total():
    per_bar = {
        "stage 0": {"backward/all_reduce": 6000, "total": 6000},
        "stage 3": {"forward/all_gather": 3000, "backward/all_gather": 3000, "backward/reduce_scatter": 3000,
                    "total": 9000},
    }
    fig = viz.ledger_bars(per_bar, theory={"stage 0": 6000, "stage 3": 9000}, unit="B")
    ax = fig.axes[0]
    bars = bars_by_label(ax)
    assert "total" not in bars
    # forward before backward; within a phase by op name
    assert list(bars) == ["forward/all-gather", "backward/all-gather", "backward/all-reduce",
                          "backward/reduce-scatter"]
    assert bars["backward/all-reduce"] == [(0, 6000), (6000, 0)]
    tops = [sum(h for _, h in (bars[k][i] for k in bars)) for i in range(2)]
    assert tops == [6000, 9000]
    assert theory_lines(ax) == [6000, 9000]


def boxes(ax) -> dict[str, list[tuple[float, float, float]]]:
    """{gid: [(x, width, y)]} for the broken_barh boxes."""
    out: dict[str, list] = {}
    for coll in ax.collections:
        if isinstance(coll, PolyCollection) and coll.get_gid():
            for path in coll.get_paths():
                v = path.vertices
                out.setdefault(coll.get_gid(), []).append(
                    (round(v[:, 0].min(), 6), round(v[:, 0].max() - v[:, 0].min(), 6), round(v[:, 1].min(), 6)))
    return out


def test_timeline_places_compute_and_comm_boxes_per_rank():
    t0 = 1000.0
    ranks = [
        {"rank": 0, "compute": [("forward", t0, t0 + 0.010), ("backward", t0 + 0.010, t0 + 0.030)],
         "comm": [("all_reduce", "grads", "backward", t0 + 0.020, 0.005, 100)]},
        {"rank": 1, "compute": [("forward", t0 + 0.002, t0 + 0.012)],
         "comm": [("all_reduce", "grads", "backward", t0 + 0.021, 0.004, 100)]},
    ]
    fig = viz.timeline(ranks)
    ax = fig.axes[0]
    b = boxes(ax)
    # times in ms from the earliest start; rank 0 drawn on top (y = 1), rank 1 below (y = 0)
    assert b["compute:forward"] == [(0.0, 10.0, 1.05), (2.0, 10.0, 0.05)]
    assert b["compute:backward"] == [(10.0, 20.0, 1.05)]
    assert b["comm:all_reduce"] == [(20.0, 5.0, 0.57), (21.0, 4.0, -0.43)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    with pytest.raises(ValueError, match="no compute phase"):
        viz.timeline([{"rank": 0, "compute": [], "comm": []}])


def _timeline_rank(rank: int, world: int) -> dict:
    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    engine, *_ = zeroedu.initialize(model=MLP(seed=0), config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    x, y = shard_batch(*mlp_batch(0, 8), rank, world)
    engine.train_batch((x, y), mlp_loss)
    return {"data": viz.timeline_data(engine, step=0), "n_entries": len(engine.ledger.select(step=0)),
            "phases": [p for p, _, _ in engine.timeline]}


def test_timeline_data_from_real_ranks_draws():
    results = zeroedu.launch(_timeline_rank, world_size=2)
    for rank, r in enumerate(results):
        data = r["data"]
        assert data["rank"] == rank
        assert [p for p, _, _ in data["compute"]] == r["phases"] == ["forward", "backward", "step"]
        assert len(data["comm"]) == r["n_entries"] > 0
        ops = {c[0] for c in data["comm"]}
        # init broadcasts the weights; the step: grads, params (no norm all-reduce: nothing clips)
        assert ops == {"broadcast", "reduce_scatter", "all_gather"}
    fig = viz.timeline([r["data"] for r in results])
    b = boxes(fig.axes[0])
    assert len(b["comm:reduce_scatter"]) == sum(
        1 for r in results for c in r["data"]["comm"] if c[0] == "reduce_scatter")


def test_scaling_plot_points_and_curves():
    measured = {"stage 0": {1: 16 * KiB, 2: 16 * KiB}, "stage 3": {1: 16 * KiB, 2: 8 * KiB}}
    theory = {"stage 3": {1: 16 * KiB, 2: 8 * KiB, 4: 4 * KiB}}
    fig = viz.scaling_plot(measured, theory, unit="KiB")
    ax = fig.axes[0]
    got = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert got["stage 0: measured"] == ([1, 2], [16, 16])
    assert got["stage 3: measured"] == ([1, 2], [16, 8])
    assert got["stage 3: theory"] == ([1, 2, 4], [16, 8, 4])
    assert "stage 0: theory" not in got
    assert list(ax.get_xticks()) == [1, 2, 4]      # the curve runs to 4: its x has a tick too (issue 31, notebook 07)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("data-parallel ranks N", "bytes per rank (KiB)")
    other = viz.scaling_plot(measured, xlabel="gradient accumulation steps A", ylabel="bytes sent per step")
    assert (other.axes[0].get_xlabel(), other.axes[0].get_ylabel()) == ("gradient accumulation steps A",
                                                                        "bytes sent per step (KiB)")


def test_alpha_beta_plot_lines_follow_the_ring_model():
    alpha, beta, n = 50e-6, 1e9, 4
    sizes = [1e3, 1e5, 1e7]
    fig = viz.alpha_beta_plot(sizes, {"all_reduce": [1e-4, 5e-4, 0.03]}, world_size=n, fit=(alpha, beta))
    ax = fig.axes[0]
    (measured,) = [ln for ln in ax.get_lines() if ln.get_gid() == "measured"]
    (model,) = [ln for ln in ax.get_lines() if ln.get_gid() == "theory"]
    assert list(measured.get_ydata()) == pytest.approx([0.1, 0.5, 30.0])
    # ring all-reduce: 2(N-1) steps of latency, 2(N-1)/N * S bytes sent
    x = model.get_xdata()
    want = [(2 * (n - 1) * alpha + 2 * (n - 1) * int(s) / n / beta) * 1e3 for s in x]
    assert list(model.get_ydata()) == pytest.approx(want)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all("times" not in t and "^" not in t for t in labels), labels   # plain milliseconds


def test_ring_grid_one_panel_per_step_with_contributors():
    n = 3
    start = np.array([[1 << r] * n for r in range(n)])
    after = start.copy()
    after[0, 2] = 0b011
    fig = viz.ring_grid([start, after], titles=["start", "step 1"])
    assert len(fig.axes) == 2
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert texts[2] == "0+1"          # rank 0, chunk 2 holds ranks 0 and 1's contributions
    full = np.full((n, n), 0b111)
    fig = viz.ring_grid([full])
    assert {t.get_text() for t in fig.axes[0].texts} == {"all"}


def test_fmt_bytes_and_table():
    assert viz.fmt_bytes(512) == "512 B"
    assert viz.fmt_bytes(1536) == "1.5 KiB"
    assert viz.fmt_bytes(112e9, unit="GB", digits=0) == "112 GB"
    with pytest.raises(ValueError, match="unit must be"):
        viz.fmt_bytes(1, unit="furlongs")
    text = viz.table([["stage 0", 16], ["stage 3", 4]], ["stage", "bytes"])
    assert text.splitlines() == ["stage    bytes", "-------  -----", "stage 0     16", "stage 3      4"]
    with pytest.raises(ValueError, match="2 headers"):
        viz.table([[1, 2, 3]], ["a", "b"])


@pytest.mark.timeout(120)
def test_every_figure_shows_in_a_notebook():
    """In a Jupyter kernel each cell that draws shows its figure (the inline backend), the second one too."""
    import nbclient
    import nbformat

    draw = "from zeroedu import viz\nfig = viz.memory_bars({'stage 0': {'parameters': 10}})"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(draw), nbformat.v4.new_code_cell(draw),
                nbformat.v4.new_code_cell("fig = viz.timeline([{'rank': 0, 'compute': [('forward', 0.0, 1.0)], "
                                          "'comm': []}])")]
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=60).execute()
    for cell in nb.cells:
        assert [o for o in cell.outputs if "image/png" in o.get("data", {})], cell.source


def test_grouped_bars_one_bar_per_series_with_labels():
    fig = viz.grouped_bars({"stage 1": {"claimed": 0.0, "measured": 1.0}, "stage 3": {"claimed": 2.0, "measured": 1.5}},
                           title="t", ylabel="x DDP", reference=1.0)
    ax = fig.axes[0]
    heights = {p.get_gid(): [] for p in ax.patches}
    for p in ax.patches:
        heights[p.get_gid()].append(p.get_height())
    assert heights == {"series:claimed": [0.0, 2.0], "series:measured": [1.0, 1.5]}
    assert [t.get_text() for t in ax.texts] == ["0", "2", "1", "1.5"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["stage 1", "stage 3"]
    with pytest.raises(ValueError, match="nothing to draw"):
        viz.grouped_bars({})


def test_approx_is_masked_by_the_course_nbval_settings_and_nothing_else_is():
    """A loss printed with viz.approx reads the same to nbval on every CPU; exact numbers stay compared."""
    import re
    from pathlib import Path

    from nbval.plugin import get_sanitize_patterns

    cfg = Path(__file__).with_name("nbval_sanitize.cfg").read_text()

    def sanitize(text: str) -> str:
        for regex, replace in get_sanitize_patterns(cfg):
            text = re.sub(regex, replace, text)
        return text

    avx2, avx512 = f"loss {viz.approx(4.88321)} after 1,024 bytes", f"loss {viz.approx(4.88309)} after 1,024 bytes"
    assert avx2 == "loss ≈4.8832 after 1,024 bytes" and avx512 == "loss ≈4.8831 after 1,024 bytes"
    assert sanitize(avx2) == sanitize(avx512)
    assert viz.approx([1.0, -2.5e-7], 2) == "≈1.00, ≈-0.00"
    assert sanitize("ratio 1.5000, 3 steps") == "ratio 1.5000, 3 steps"


# ---- notebooks 00-04 (course part A): per-bucket backward, distinguishable alpha-beta lines ------------------

def test_backward_segments_cut_at_each_bucket():
    comm = [("all_reduce", "grads", "backward", 2.0, 1.0, 8), ("all_reduce", "grads", "backward", 5.0, 2.0, 8)]
    # overlap: backward computes on while the collectives run; the cuts are the buckets' launch times
    assert viz.backward_segments(0.0, 10.0, comm, overlap=True) == ([(0.0, 2.0), (2.0, 5.0), (5.0, 10.0)], [])
    # inline: backward stops for each collective, as long as it lasts
    assert viz.backward_segments(0.0, 10.0, comm, overlap=False) == ([(0.0, 2.0), (3.0, 5.0), (7.0, 10.0)],
                                                                    [(2.0, 3.0), (5.0, 7.0)])
    assert viz.backward_segments(0.0, 10.0, [], overlap=False) == ([(0.0, 10.0)], [])


def test_timeline_draws_inline_waits_and_overlapped_segments_differently():
    t0 = 100.0
    comm = [("all_reduce", "grads", "backward", t0 + 0.004, 0.002, 8),
            ("all_reduce", "grads", "backward", t0 + 0.008, 0.002, 8)]
    for overlap, segments, waits in ((True, 3, 0), (False, 3, 2)):
        rank = {"rank": 0, "compute": [("backward", t0, t0 + 0.012)], "comm": comm, "overlap": overlap}
        ax = viz.timeline([rank]).axes[0]
        b = boxes(ax)
        assert len(b["compute:backward"]) == segments and len(b.get("wait:comm", [])) == waits
        drawn = sum(w for _, w, _ in b["compute:backward"]) + sum(w for _, w, _ in b.get("wait:comm", []))
        assert drawn == pytest.approx(12.0)     # segments and waits tile the 12 ms of backward
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert ("backward waits for its collective" in legend) == (not overlap)
    assert viz.timeline([rank], xmax=50.0).axes[0].get_xlim() == (0.0, 50.0)


def test_alpha_beta_lines_can_be_told_apart():
    sizes = [1e3, 1e5, 1e7]
    seconds = {op: [1e-4, 1e-3, 1e-2] for op in ("all_reduce", "reduce_scatter", "all_gather")}
    ax = viz.alpha_beta_plot(sizes, seconds, world_size=4, fit=(50e-6, 1e9)).axes[0]
    models = [ln for ln in ax.get_lines() if ln.get_gid() == "theory"]
    # reduce-scatter and all-gather have the same model (N-1 steps, (N-1)/N S bytes): one line named for both
    assert [ln.get_label() for ln in models] == ["all-reduce: alpha-beta", "reduce-scatter = all-gather: alpha-beta"]
    assert len({ln.get_linestyle() for ln in models}) == 2
    measured = [ln for ln in ax.get_lines() if ln.get_gid() == "measured"]
    assert len({ln.get_marker() for ln in measured}) == 3


# ---- notebooks 05-10 (course part B) ------------------------------------------------------------------------------

def test_scaling_plot_starts_at_zero_and_draws_floors():
    fig = viz.scaling_plot({"stage 1": {1: 16.0, 2: 10.0, 4: 7.0}}, floors={"4 Psi": 4.0, "2 Psi": 2.0}, unit="B")
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0
    floors = sorted(line.get_ydata()[0] for line in ax.get_lines() if line.get_gid() == "floor")
    assert floors == [2.0, 4.0]
    assert {t.get_text() for t in ax.texts} == {"4 Psi", "2 Psi"}
    assert viz.scaling_plot({"s": {1: 10.0, 2: 5.0}}, logy=True, unit="B").axes[0].get_ylim()[0] > 0


def test_offload_timelines_share_x_and_name_every_lane():
    t0 = 100.0
    step = {"t0": t0, "compute": [("forward", t0, t0 + 0.01), ("backward", t0 + 0.01, t0 + 0.03),
                                  ("step", t0 + 0.03, t0 + 0.04)],
            "adam": [("adam", t0 + 0.031, t0 + 0.035)],
            "events": [("d2h", "offload", t0 + 0.02, 0.001), ("h2d", "offload", t0 + 0.036, 0.001),
                       ("reduce_scatter", "grads", t0 + 0.015, 0.002)]}
    short = {**step, "compute": step["compute"][:2]}
    fig = viz.offload_timelines({"a": step, "b": short})
    a, b = fig.axes
    assert a.get_xlim() == b.get_xlim()                     # one x range for both panels
    lanes = [t.get_text() for t in a.get_yticklabels()]
    assert lanes == list(viz.OFFLOAD_LANES)
    labels = [t.get_text() for t in a.get_legend().get_texts()]
    assert labels[:3] == ["compute: forward", "compute: backward", "compute: step"]
    assert {"Adam on the host CPU", "device -> host", "host -> device", "NVMe -> host", "host -> NVMe",
            "collective: reduce-scatter"} <= set(labels)
    boxes = {c.get_gid(): c for c in a.collections if isinstance(c, PolyCollection)}
    assert {"compute:forward", "cpu adam", "offload:d2h", "offload:h2d", "comm:reduce_scatter"} <= set(boxes)
    # the d2h copy sits in the d2h lane (index 2), from 20 ms
    x0, y0 = boxes["offload:d2h"].get_paths()[0].vertices.min(axis=0)
    assert x0 == pytest.approx(20.0) and y0 == pytest.approx(2 - 0.4)
    with pytest.raises(ValueError, match="no step"):
        viz.offload_timelines({})
