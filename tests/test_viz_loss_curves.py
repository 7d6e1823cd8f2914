"""zeroedu.viz's plots for notebooks 09 and 10: loss_curves draws the losses it is given, the reference run as a
band, and the relative difference in percent on a second panel; block_errors one bar per block under its bound;
grouped_bars' theory markers."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from zeroedu import viz  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_curves_steps_and_the_mark():
    fig = viz.loss_curves({"uninterrupted": [4.0, 3.5, 3.0, 2.5], "before": ([0, 1], [4.0, 3.5]),
                           "after": ([2, 3], [3.0, 2.5])}, reference="uninterrupted", mark=1.5)
    (ax,) = fig.axes
    lines = _lines(ax)
    assert lines["uninterrupted"] == ([0, 1, 2, 3], [4.0, 3.5, 3.0, 2.5])
    assert lines["before"] == ([0, 1], [4.0, 3.5]) and lines["after"] == ([2, 3], [3.0, 2.5])
    assert any(list(line.get_xdata()) == [1.5, 1.5] for line in ax.get_lines())     # the dotted mark


def test_relative_panel_is_the_difference_in_percent():
    fig = viz.loss_curves({"stage 3": [2.0, 4.0], "qwZ": [2.02, 3.96]}, reference="stage 3", relative=True)
    assert len(fig.axes) == 2
    xs, ys = _lines(fig.axes[1])["qwZ"]
    assert xs == [0, 1] and ys == pytest.approx([1.0, -1.0])


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="empty"):
        viz.loss_curves({})
    with pytest.raises(ValueError, match="not one of the curves"):
        viz.loss_curves({"a": [1.0]}, reference="b")
    with pytest.raises(ValueError, match="needs a reference"):
        viz.loss_curves({"a": [1.0]}, relative=True)


def test_block_errors_draws_one_bar_per_block_under_its_bound():
    fig = viz.block_errors([1e-4, 2e-3, 5e-5], [2e-4, 4e-3, 1e-4], xlabel="block of 256 elements")
    (ax,) = fig.axes
    assert [p.get_height() for p in ax.patches] == pytest.approx([1e-4, 2e-3, 5e-5])
    assert ax.get_yscale() == "log"
    assert list(_lines(ax)["bound"][1]) == pytest.approx([2e-4, 4e-3, 1e-4])
    with pytest.raises(ValueError, match="one of each per block"):
        viz.block_errors([1.0], [1.0, 2.0])


def test_grouped_bars_draws_a_theory_marker_on_each_bar_that_has_one():
    fig = viz.grouped_bars({"stage 3": {"out": 4.0, "in": 2.0}, "hpZ": {"out": 3.0, "in": 2.5}},
                           theory={"stage 3": {"out": 4.0}, "hpZ": {"out": 2.9, "in": 2.5}})
    (ax,) = fig.axes
    markers = [line for line in ax.get_lines() if line.get_gid() == "theory"]
    assert sorted(line.get_ydata()[0] for line in markers) == pytest.approx([2.5, 2.9, 4.0])
    assert [line.get_label() for line in markers].count("theory") == 1     # named once in the legend
