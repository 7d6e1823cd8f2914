"""Figures and widgets speak the notebook's language: with zeroedu.lang("zh") every word a course plot draws is
Chinese (names of collectives, numbers and units aside), with "en" nothing changes; every title a lesson passes to
a plot has a Chinese entry, so the Chinese edition's figures are Chinese too."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from zeroedu import i18n  # noqa: E402
from zeroedu.course import viz  # noqa: E402
from zeroedu.i18n import figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURE_ARGS = {"title", "xlabel", "ylabel", "suptitle", "theory_label", "measured_label", "bound_label"}


@pytest.fixture
def zh():
    before = i18n.current()
    i18n.lang("zh")
    yield
    i18n.lang(before)


def _plots():
    per_bar = {"stage 0": {"parameters": 4e5, "gradients": 4e5, "master_weights": 8e5, "optimizer_state": 1.6e6},
               "stage 3": {"parameters": 1e5, "gradients": 1e5, "master_weights": 2e5, "optimizer_state": 4e5,
                           "activations": 3e5}}
    yield viz.memory_bars(per_bar, theory={"stage 0": 3.2e6, "stage 3": 8e5},
                          title="Model states per rank, bf16 + Adam, N = 4")
    yield viz.ledger_bars({"stage 0": {"backward/all_reduce": 6e5}, "stage 3": {"forward/all_gather": 3e5,
                                                                                "backward/reduce_scatter": 3e5}},
                          title="Bytes each rank sends per step, bf16, N = 4")
    yield viz.loss_curves({"reference": [2.0, 1.5, 1.2], "stage 3": [2.0, 1.5, 1.2]}, title="")
    yield viz.block_errors([0.1, 0.2], [0.3, 0.3], title="int8 blocks of TinyGPT's embedding, one outlier planted")
    yield viz.scaling_plot({"stage 3": {1: 16.0, 4: 4.0}}, {"stage 3": {1: 16.0, 4: 4.0}},
                           floors={"stage 1 floor: 4Ψ (parameters + gradients)": 4.0},
                           title="Bytes per rank per optimizer step, fp32, N = 4 (stages 0 and 1 coincide)")


def test_every_word_is_chinese(zh):
    for fig in _plots():
        assert figures.untranslated(fig) == [], fig.axes[0].get_title()
        assert any("\u4e00" <= ch <= "\u9fff" for t in figures._texts(fig) for ch in t.get_text())


def test_english_stays_english():
    assert i18n.current() == "en"
    for fig in _plots():
        assert not any("\u4e00" <= ch <= "\u9fff" for t in figures._texts(fig) for ch in t.get_text())


def _passed_strings() -> set[str]:
    """Every string literal a lesson passes to a plot as a title or label (f-strings are checked by pattern)."""
    found = set()
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "\n".join(line for line in "".join(cell["source"]).splitlines() if not line.startswith(("!", "%")))
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.keyword) and node.arg in FIGURE_ARGS and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str) and node.value.value:
                    found.add(node.value.value)
    return found


def test_the_lessons_titles_are_in_the_catalogue():
    missing = sorted(s for s in _passed_strings() if figures.translate(s) == s and s not in {"N"})
    assert not missing, f"add these to zeroedu/i18n/figures.py PHRASES: {missing}"


def test_widget_labels_follow_the_language(zh):
    from zeroedu.course import widgets

    assert widgets._desc("precision") == "精度"
    i18n.lang("en")
    assert widgets._desc("precision") == "precision"
