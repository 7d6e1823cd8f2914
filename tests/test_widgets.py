"""zeroedu.widgets: the text functions against bytes worked out here, and the widgets driven from Python."""

from __future__ import annotations

import base64
import html

import pytest

from zeroedu import widgets

pytestmark = pytest.mark.timeout(60)
# The calculator's default activations for 7.5e9 parameters, worked out by hand: the GPT-style shape with
# 12·L·h² = 7.5e9 and L = h/128 is h = 4352 (34 heads of 128), L = 33; with full recomputation and flash attention
# backward's peak holds the L layer inputs (2sbh each) and one layer's 34sbh: (2 x 33 + 34) x 4096 x 1 x 4352.
ACT_7_5B = 100 * 4096 * 4352
WIDGET_DEFAULTS = {"seq_len": 4096, "micro_batch": 1, "recompute": "full", "gpu_gb": 80.0}


def test_calculator_text_numbers():
    # 7.5e9 parameters on 64 ranks, bf16 + Adam: 16 x 7.5e9 / 64 = 1.875e9 bytes at stage 3 (Table 1: 1.88 GB).
    t3 = widgets.calculator_text(7.5e9, 64, 3, "bf16")
    assert "total              1,875,000,000 B" in t3
    # Stage 3 all-gathers twice and reduce-scatters once: 3 x 63/64 x 15e9 bytes.
    assert f"{3 * 63 * 15 * 10**9 // 64:,} B" in t3
    t0 = widgets.calculator_text(7.5e9, 64, 0, "bf16")
    assert "120,000,000,000 B" in t0
    assert f"backward/all_reduce     {2 * 63 * 15 * 10**9 // 64:>16,} B" in t0
    # Optimizer offload at stage 2: the device keeps only the bf16 parameters (2 x 7.5e9); the host holds
    # 16 bytes x 7.5e9 / 64 (fp32 gradient shard + fp32 master + Adam).
    t2 = widgets.calculator_text(7.5e9, 64, 2, "bf16", "cpu")
    assert "device  total             15,000,000,000 B" in t2
    assert "host    total              1,875,000,000 B" in t2
    assert "offload traffic per step" in t2
    assert widgets.calculator_text(7.5e9, 64, 0, "bf16", "cpu").startswith("error: optimizer offload needs stage")


def test_memory_calculator_follows_its_controls():
    calc = widgets.memory_calculator(psi=7.5e9, world_size=64, stage=3)
    assert calc.text == widgets.calculator_text(7.5e9, 64, 3, "bf16", **WIDGET_DEFAULTS)
    calc.controls["stage"].value = 1
    calc.controls["world_size"].value = 8
    want = widgets.calculator_text(7.5e9, 8, 1, "bf16", **WIDGET_DEFAULTS)
    assert calc.text == want and "stage 1" in calc.text
    # Stage 1 on 8 ranks: 4 x 7.5e9 + 12 x 7.5e9 / 8 = 41.25e9 bytes.
    assert "41,250,000,000 B" in calc.text
    assert html.escape(want) in calc.output.value
    calc.controls["offload"].value = "optimizer + params -> CPU"
    assert calc.text.startswith("error: parameter offload works only at stage 3")
    calc.controls["stage"].value = 3
    assert "host    parameters" in calc.text
    calc.controls["billions"].value = 1.0
    assert "psi = 1,000,000,000 parameters" in calc.text
    assert calc._repr_mimebundle_() is not None


def test_planner_widget_follows_its_controls():
    w = widgets.planner_widget(model="7B", gpus=8)
    assert w.text == widgets.planner_text(model="7B", gpus=8, gpus_per_node=8, gpu_memory_gb=80.0,
                                          intra="nvlink", inter="infiniband", precision="bf16", micro_batch=1,
                                          seq_len=2048)
    assert "Recommendation: stage 1" in w.text
    w.controls["model"].value = "70B"
    assert "Recommendation: stage 3 + offload opt" in w.text
    w.controls["gpus"].value = 12      # not whole nodes of 8: the error shows instead of a table
    assert w.text.startswith("error: 12 GPUs are not whole nodes of 8")
    w.controls["gpus"].value = 64
    assert "64 GPUs (8 nodes of 8)" in w.text


def test_planner_widget_offers_a_calibrated_link():
    from zeroedu import planner

    lk = planner.Link("this machine", 1e-3, 0.3e9, "fit to 18 collectives from a notebook")
    w = widgets.planner_widget(model="1.3B", gpus=4, gpus_per_node=4, intra=lk)
    assert ("this machine", lk) in w.controls["intra"].options and w.controls["intra"].value is lk
    assert "intra-node this machine: alpha 1000.0 us, beta 0.3 GB/s" in w.text
    w.controls["intra"].value = "nvlink"
    assert "intra-node nvlink" in w.text


def test_calculator_chart_follows_its_controls():
    """The chart's bars are bytes per rank from the closed forms: 7.5e9 parameters on 64 ranks, bf16 + Adam,
    16 / 4 + 12/64 / 2 + 14/64 / 16/64 bytes per parameter (the ZeRO paper's Figure 1: 120 / 31.4 / 16.6 / 1.9)."""
    calc = widgets.memory_calculator(psi=7.5e9, world_size=64, stage=3)
    totals = {k: sum(v.values()) for k, v in calc.chart_data.items()}
    states = {"stage 0": 120_000_000_000, "stage 1": 31_406_250_000, "stage 2": 16_640_625_000,
              "stage 3 *": 1_875_000_000}
    assert totals == {k: v + ACT_7_5B for k, v in states.items()}     # every stage pays the same activations
    assert all(bar["activations"] == ACT_7_5B for bar in calc.chart_data.values())
    assert calc.chart.value == calc.png and calc.png.startswith(b"\x89PNG")
    before = calc.png
    calc.controls["stage"].value = 1                      # the mark moves, the picture is redrawn
    assert [k for k in calc.chart_data if k.endswith("*")] == ["stage 1 *"] and calc.png != before
    calc.controls["offload"].value = "optimizer -> CPU"   # stage 1 + optimizer offload: a host bar appears
    host = calc.chart_data["host, stage 1 *"]
    # host: fp32 gradient shard + fp32 master + Adam's two moments, 16 bytes x 7.5e9 / 64
    assert sum(host.values()) == 1_875_000_000
    assert "stage 0 (no offload)" in calc.chart_data     # stage 0 cannot offload: drawn without it
    calc.controls["offload"].value = "optimizer + params -> CPU"   # not at stage 1: no host bar, text says why
    assert calc.text.startswith("error:") and not any(k.startswith("host") for k in calc.chart_data)


def test_widgets_have_a_one_line_static_repr():
    calc = widgets.memory_calculator(psi=7.5e9, world_size=64, stage=3)
    want = ("memory calculator: 7.5B parameters, N = 64, stage 3, bf16: 1.875 GB of model states per rank on the "
            f"device, {3 * 63 * 15e9 / 64 / 1e9:.3f} GB sent per step; with activations "
            f"{(1.875e9 + ACT_7_5B) / 1e9:.3f} GB, fits in 80 GB")
    assert repr(calc) == want
    bundle = calc._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["text/plain"] == want and "\n" not in want and "VBox" not in want
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG")     # what a static viewer shows
    calc.controls["world_size"].value = 8
    assert repr(calc).startswith("memory calculator: 7.5B parameters, N = 8, stage 3")
    w = widgets.planner_widget(model="7B", gpus=8)
    assert repr(w) == "planner: 7B on 8 GPUs -> recommendation: stage 1"
    w.controls["gpus"].value = 12
    assert repr(w).startswith("planner: error: 12 GPUs are not whole nodes of 8")
    assert w._repr_mimebundle_()["text/plain"] == repr(w)


def test_calculator_starts_at_8_ranks_with_activations_and_a_gpu():
    """Issue 31: at N = 1 every stage is the same; the calculator starts at N = 8, with activations (recomputation
    on) and a verdict against an 80 GB GPU, and the verdicts follow the closed forms."""
    calc = widgets.memory_calculator(psi=7.5e9, stage=0)
    assert calc.controls["world_size"].value == 8 and calc.controls["gpu_gb"].value == 80.0
    assert "does NOT fit" in calc.text                     # stage 0: 16 x 7.5e9 = 120 GB of model states alone
    calc.controls["stage"].value = 3                       # 120 GB / 8 = 15 GB + 1.78 GB of activations
    assert "  on one GPU of 80 GB: fits" in calc.text and f"{ACT_7_5B:,} B" in calc.text
    calc.controls["recompute"].value = "none"              # every layer keeps its 34sbh: 33 x 34 x 4096 x 4352
    assert f"{33 * 34 * 4096 * 4352:,} B" in calc.text
    calc.controls["seq_len"].value = 0                     # no sequence: no activation lines, no activation bars
    assert "activations" not in calc.text and all("activations" not in b for b in calc.chart_data.values())


def test_the_calculators_text_speaks_the_notebooks_language(monkeypatch):
    """Issue 28: the memory calculator's printed table (lesson 01 prints calc.text) follows zeroedu.lang: the same
    numbers on the same lines, its prose in 中文 under zh, in English otherwise."""
    import re

    import zeroedu
    from zeroedu.i18n import ENV

    monkeypatch.setenv(ENV, "en")
    kw = dict(psi=7e9, world_size=8, stage=2, offload_optimizer="cpu", seq_len=4096, gpu_gb=80)
    english = widgets.calculator_text(**kw)
    zeroedu.lang("zh")
    chinese = widgets.calculator_text(**kw)
    from test_translations import _NUMBER as numbers  # a number standing alone, as the saved-output check reads it
    assert [numbers.findall(line) for line in english.splitlines()] == \
        [numbers.findall(line) for line in chinese.splitlines()]
    assert "model states per rank (1 GB = 1e9 bytes):" in english and not re.search(r"[\u4e00-\u9fff]", english)
    assert "每个 rank 的模型状态（1 GB = 1e9 字节）：" in chinese and "单卡 80 GB：放得下（占 20%" in chinese
