"""ipywidgets calculators, each a thin layer over a pure function that returns text.

    from zeroedu.course.widgets import memory_calculator, planner_widget
    memory_calculator()      # model size, N, stage, precision, offload -> bytes per rank and comm per step
    planner_widget()         # zeroedu.planner.plan for a model and a cluster

The text functions (`calculator_text`, `planner_text`) hold all the arithmetic and are what the tests check;
a widget only reads its controls and shows the text (the calculator also a bar chart of bytes per rank at
every stage, `calculator_bars`, redrawn on each change). Set a control's `.value` from Python and `.text`
follows, which is how the tests drive them (and how a notebook can, without a browser).

Saved in a notebook, a widget also leaves a one-line text (`summary`) and, for the calculator, the chart as
a PNG: what GitHub's viewer and nbval see, instead of `VBox(children=...)`.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable

import ipywidgets as widgets

from zeroedu import theory
from zeroedu.i18n import tr
from zeroedu.theory import planner

GB = theory.GB
OFFLOADS = {   # label -> (offload_optimizer, offload_param)
    "none": ("none", "none"),
    "optimizer -> CPU": ("cpu", "none"),
    "optimizer -> NVMe": ("nvme", "none"),
    "optimizer + params -> CPU": ("cpu", "cpu"),
    "optimizer + params -> NVMe": ("nvme", "nvme"),
}


# the controls' labels in Chinese (zeroedu.lang('zh'))
LABELS_ZH = {
    "parameters (billions)": "参数量（十亿）",
    "N (ranks)": "N（rank 数）",
    "ZeRO stage": "ZeRO stage",
    "precision": "精度",
    "offload": "卸载",
    "grad accumulation": "梯度累积",
    "model": "模型",
    "GPUs": "GPU 数",
    "GPUs per node": "每节点 GPU 数",
    "GPU GB": "显存 GB",
    "intra-node": "节点内互联",
    "inter-node": "节点间互联",
    "micro-batch": "微批次",
    "sequence": "序列长度",
    "recompute": "激活重计算",
}

# the chart's words in Chinese, added to zeroedu.i18n.figures' catalogue
CHART_ZH = [(r"^([\d.]+)B parameters, N = (\d+), (\w+): bytes per rank \(\* = selected\)$",
             r"\1B 参数，N = \2，\3：每卡字节数（* = 选中的 stage）"),
            (r"^GPU memory: ([\d.]+) GB$", r"GPU 显存：\1 GB")]


def gpt_shape(psi: float) -> tuple[int, int, int]:
    """(hidden size h, layers L, heads) of a GPT-style model with about psi parameters, for the activation bar:
    12·L·h² = psi with L = h/128 (about the aspect ratio of GPT-3 and Llama), h a multiple of 128, 128-wide heads."""
    h = max(128, round((128 * psi / 12) ** (1 / 3) / 128) * 128)
    return h, max(1, round(psi / (12 * h * h))), h // 128


def activation_per_rank(psi: float, seq_len: int, micro_batch: int, recompute: str = "full") -> int:
    """Activation bytes per rank at the peak of backward, 16-bit, flash attention (theory.activation_bytes, the
    Korthikanti count) for gpt_shape(psi). ZeRO's data parallelism does not shard them: every stage pays them."""
    h, layers, heads = gpt_shape(psi)
    return theory.activation_bytes(int(seq_len), int(micro_batch), h, heads, layers, recompute, flash_attention=True)


def _desc(label: str) -> str:
    return tr(label, LABELS_ZH.get(label, label))


def _b(n: float) -> str:
    return f"{float(n):>16,.0f} B {float(n) / GB:>10.3f} GB"


def calculator_text(psi: float, world_size: int, stage: int, precision: str = "bf16",
                    offload_optimizer: str = "none", offload_param: str = "none", grad_accum: int = 1,
                    optimizer: str = "adam", seq_len: int = 0, micro_batch: int = 1, recompute: str = "full",
                    gpu_gb: float = 0.0) -> str:
    """Bytes per rank by tier and category, and bytes each rank sends per step, from zeroedu.theory."""
    try:
        psi, world_size, stage, grad_accum = int(round(psi)), int(world_size), int(stage), int(grad_accum)
        tiers = theory.offload_bytes(psi, world_size, stage, precision, offload_optimizer, offload_param,
                                     optimizer=optimizer)
        comm = theory.comm_bytes_per_step(psi, world_size, stage, precision, grad_accum)
        moved = (theory.offload_transfer_bytes_per_step(psi, world_size, stage, precision, offload_optimizer,
                                                        offload_param, grad_accum, optimizer=optimizer)
                 if offload_optimizer != "none" or offload_param != "none" else None)
    except ValueError as e:
        return tr(f"error: {e}", f"错误：{e}")
    k = theory.optimizer_K(precision, optimizer)
    lines = [tr(f"psi = {psi:,} parameters, N = {world_size}, stage {stage}, {precision}, {optimizer} "
                f"(K = {k} bytes/param), gradient accumulation {grad_accum}",
                f"psi = {psi:,} 个参数，N = {world_size}，stage {stage}，{precision}，{optimizer}"
                f"（K = {k} 字节/参数），梯度累积 {grad_accum}"),
             "", tr("model states per rank (1 GB = 1e9 bytes):", "每个 rank 的模型状态（1 GB = 1e9 字节）：")]
    for tier, cats in tiers.items():
        if cats["total"] or tier == "device":
            for cat in (*theory.MODEL_STATES, "total"):
                lines.append(f"  {tier:<7} {cat:<16}{_b(cats[cat])}")
    if offload_optimizer == "none" and offload_param == "none":
        paper = theory.model_state_bytes_paper(psi, world_size, stage, K=k) if precision != "fp32" else None
        if paper is not None:
            label = tr("  paper formula (unpadded, 2+2+K bytes/param):",
                       "  论文公式（不含 padding，2+2+K 字节/参数）：")
            lines.append(label + _b(paper))
    if seq_len:
        h, layers, heads = gpt_shape(psi)
        act = activation_per_rank(psi, seq_len, micro_batch, recompute)
        both = tiers["device"]["total"] + act
        lines += ["", tr(f"activations per rank (a GPT-style shape: h = {h}, L = {layers}, {heads} heads; sequence "
                         f"{seq_len}, micro-batch {micro_batch}, recompute {recompute}, flash attention):",
                         f"每个 rank 的激活值（GPT 式形状：h = {h}，L = {layers}，{heads} 个头；序列长度 {seq_len}，"
                         f"micro-batch {micro_batch}，重计算 {recompute}，flash attention）："),
                  tr("  activations             ", "  激活值                  ") + _b(act),
                  tr("  model states + activations", "  模型状态 + 激活值         ") + _b(both)]
        if gpu_gb:
            share = f"{both / (gpu_gb * GB):.0%}"
            lines.append(tr(f"  on one GPU of {gpu_gb:g} GB: {'fits' if both <= gpu_gb * GB else 'does NOT fit'} "
                            f"({share} of it, before buffers and the allocator's fragmentation)",
                            f"  单卡 {gpu_gb:g} GB：{'放得下' if both <= gpu_gb * GB else '放不下'}"
                            f"（占 {share}，未计缓冲区和分配器的碎片）"))
    lines += ["", tr("bytes each rank sends per step (ring collectives, compute dtype):",
                     "每个 rank 每步发送的字节数（ring 集合通信，计算 dtype）：")]
    for key, v in comm.items():
        lines.append(f"  {key:<24}{_b(v)}")
    units, p = theory.comm_volume_paper(stage), theory.param_bytes(precision)
    total = f"{units * psi * p / GB:.3f}"
    lines.append(tr(f"  paper: {units} psi x {p} bytes = {total} GB (large-N limit of the ring)",
                    f"  论文：{units} psi x {p} 字节 = {total} GB（ring 在 N 很大时的极限）"))
    if moved:
        lines += ["", tr("offload traffic per step:", "每步 offload 的传输量：")]
        lines += [f"  {key:<28}{_b(v)}" for key, v in moved.items()]
    return "\n".join(lines)


def planner_text(**kwargs) -> str:
    """zeroedu.planner.format_plan(plan(**kwargs)), or the error."""
    try:
        return planner.format_plan(planner.plan(**kwargs))
    except ValueError as e:
        return f"error: {e}"


def calculator_bars(psi: float, world_size: int, stage: int, precision: str = "bf16",
                    offload_optimizer: str = "none", offload_param: str = "none", grad_accum: int = 1,
                    optimizer: str = "adam", seq_len: int = 0, micro_batch: int = 1, recompute: str = "full",
                    gpu_gb: float = 0.0) -> dict[str, dict[str, int]]:
    """What the calculator's chart draws: {bar: {category: bytes}} per rank, from zeroedu.theory.

    One bar per stage 0-3 on the device, with this offload where that stage allows it (the others without
    offload, labelled so), then the selected stage's host and NVMe tiers if they hold anything. With seq_len,
    every device bar carries the activations too (the same at every stage)."""
    psi, world_size, stage = int(round(psi)), int(world_size), int(stage)
    act = {"activations": activation_per_rank(psi, seq_len, micro_batch, recompute)} if seq_len else {}
    bars: dict[str, dict[str, int]] = {}
    for s in theory.STAGES:
        try:
            tiers = theory.offload_bytes(psi, world_size, s, precision, offload_optimizer, offload_param,
                                         optimizer=optimizer)
            note = ""
        except ValueError:   # this offload needs a higher stage: show the stage without it
            tiers = theory.offload_bytes(psi, world_size, s, precision, optimizer=optimizer)
            note = " (no offload)"
        mark = " *" if s == stage else ""
        bars[f"stage {s}{note}{mark}"] = {c: tiers["device"][c] for c in theory.MODEL_STATES} | act
    try:
        tiers = theory.offload_bytes(psi, world_size, stage, precision, offload_optimizer, offload_param,
                                     optimizer=optimizer)
    except ValueError:   # the selected stage cannot take this offload (the text says why): no host bars
        return bars
    for tier, name in (("host", "host"), ("nvme", "NVMe")):
        if tiers[tier]["total"]:
            bars[f"{name}, stage {stage} *"] = {c: tiers[tier][c] for c in theory.MODEL_STATES}
    return bars


def calculator_summary(psi: float, world_size: int, stage: int, precision: str = "bf16",
                       offload_optimizer: str = "none", offload_param: str = "none", grad_accum: int = 1,
                       optimizer: str = "adam", seq_len: int = 0, micro_batch: int = 1, recompute: str = "full",
                       gpu_gb: float = 0.0) -> str:
    """One line: the calculator's inputs and its two headline numbers (the widget's static text)."""
    try:
        psi, world_size, stage = int(round(psi)), int(world_size), int(stage)
        dev = theory.offload_bytes(psi, world_size, stage, precision, offload_optimizer, offload_param,
                                   optimizer=optimizer)["device"]["total"]
        sent = theory.comm_bytes_per_step(psi, world_size, stage, precision, int(grad_accum))["total"]
    except ValueError as e:
        return tr(f"memory calculator: error: {e}", f"显存计算器：错误：{e}")
    off = "" if offload_optimizer == offload_param == "none" else tr(
        f", offload optimizer {offload_optimizer} / params {offload_param}",
        f"，offload 优化器 {offload_optimizer} / 参数 {offload_param}")
    size, dev_gb, sent_gb = f"{psi / 1e9:g}B", f"{dev / GB:.3f}", f"{sent / GB:.3f}"
    line = tr(f"memory calculator: {size} parameters, N = {world_size}, stage {stage}, {precision}{off}: "
              f"{dev_gb} GB of model states per rank on the device, {sent_gb} GB sent per step",
              f"显存计算器：{size} 参数，N = {world_size}，stage {stage}，{precision}{off}：每个 rank 设备上的"
              f"模型状态 {dev_gb} GB，每步发送 {sent_gb} GB")
    if seq_len:
        both = dev + activation_per_rank(psi, seq_len, micro_batch, recompute)
        line += tr(f"; with activations {both / GB:.3f} GB", f"；加上激活值 {both / GB:.3f} GB")
        if gpu_gb:
            fits = both <= gpu_gb * GB
            line += tr(f", {'fits' if fits else 'does NOT fit'} in {gpu_gb:g} GB",
                       f"，{gpu_gb:g} GB {'放得下' if fits else '放不下'}")
    return line


def planner_summary(**kwargs) -> str:
    """One line: the planner's recommendation (the widget's static text)."""
    try:
        p = planner.plan(**kwargs)
    except ValueError as e:
        return tr(f"planner: error: {e}", f"planner：错误：{e}")
    rec = p.recommendation.label if p.recommendation else tr("none fits", "都放不下")
    model, gpus = kwargs.get("model"), kwargs.get("gpus")
    return tr(f"planner: {model} on {gpus} GPUs -> recommendation: {rec}",
              f"planner：{model}，{gpus} 张卡 -> 推荐：{rec}")


def _png(per_bar: dict[str, dict[str, int]], title: str, gpu_gb: float = 0.0) -> bytes:
    import re

    import matplotlib.pyplot as plt

    from zeroedu.course import viz
    from zeroedu.i18n import figures
    from zeroedu.i18n.figures import localize

    known = {p.pattern for p, _ in figures.PATTERNS}    # the chart's words, before the catalogue's catch-alls
    figures.PATTERNS[:0] = [(re.compile(p), r) for p, r in CHART_ZH if p not in known]
    fig = viz.memory_bars(per_bar, title=title, unit="GB")
    ax = fig.axes[0]
    if gpu_gb:   # the capacity line: a bar above it does not fit on one GPU
        ax.axhline(gpu_gb, color="black", linestyle="--", linewidth=1, label=f"GPU memory: {gpu_gb:g} GB")
        ax.legend(fontsize=8, loc="upper right", frameon=False)
        localize(fig)
    for i, cats in enumerate(per_bar.values()):   # the total on top of each bar: small bars stay readable
        total = sum(cats.values()) / GB
        ax.text(i, total, f"{total:,.3g} GB", ha="center", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


class Calculator:
    """Controls, an output, and the functions that join them. Displays as its VBox.

    render(**values) -> the text shown; summary(**values) -> one line, the static text a saved notebook
    keeps; bars(**values) -> {bar: {category: bytes}}, drawn as a chart under the text (optional)."""

    def __init__(self, controls: dict[str, widgets.ValueWidget], render: Callable[..., str],
                 convert: Callable[[dict], dict] | None = None, summary: Callable[..., str] | None = None,
                 bars: Callable[..., dict] | None = None, chart_title: Callable[[dict], str] | None = None) -> None:
        self.controls, self.render, self.convert = controls, render, convert or (lambda kw: kw)
        self.summarize, self.bars, self.chart_title = summary, bars, chart_title
        self.output = widgets.HTML()
        self.chart = widgets.Image(format="png") if bars else None
        self.text, self.summary, self.chart_data, self.png = "", "", None, b""
        rows = [widgets.HBox(list(controls.values())[i:i + 3]) for i in range(0, len(controls), 3)]
        self.widget = widgets.VBox(rows + [self.output] + ([self.chart] if self.chart else []))
        for c in controls.values():
            c.observe(self.update, names="value")
        self.update()

    def values(self) -> dict:
        return self.convert({name: c.value for name, c in self.controls.items()})

    def update(self, _change=None) -> None:
        values = self.values()
        self.text = self.render(**values)
        self.output.value = f"<pre style='font-size: 12px; line-height: 1.3'>{html.escape(self.text)}</pre>"
        self.summary = self.summarize(**values) if self.summarize else self.text.splitlines()[0]
        if self.chart is not None:
            self.chart_data = self.bars(**values)
            title = self.chart_title(values) if self.chart_title else ""
            self.png = _png(self.chart_data, title, values.get("gpu_gb", 0.0))
            self.chart.value = self.png

    def __repr__(self) -> str:
        return self.summary

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        data["text/plain"] = self.summary
        if self.png:
            data["image/png"] = base64.b64encode(self.png).decode("ascii")
        return bundle


def _style() -> dict:
    return {"style": {"description_width": "initial"}}


def memory_calculator(psi: float = 7.5e9, world_size: int = 8, stage: int = 3, precision: str = "bf16",
                      offload: str = "none", grad_accum: int = 1, seq_len: int = 4096, micro_batch: int = 1,
                      recompute: str = "full", gpu_gb: float = 80.0) -> Calculator:
    """Model size (billions), N, stage, precision, offload, sequence, micro-batch, recomputation, GPU size ->
    bytes per rank (model states and activations) against the GPU, and comm per step."""
    controls = {
        "billions": widgets.BoundedFloatText(value=psi / 1e9, min=1e-9, max=1e5, step=0.1,
                                             description=_desc("parameters (billions)"), **_style()),
        "world_size": widgets.BoundedIntText(value=world_size, min=1, max=1_000_000, description=_desc("N (ranks)"),
                                             **_style()),
        # a slider: drag it from 0 to 3 and watch each stage shard one more model state
        "stage": widgets.IntSlider(value=stage, min=min(theory.STAGES), max=max(theory.STAGES),
                                   description=_desc("ZeRO stage"), **_style()),
        "precision": widgets.Dropdown(options=list(theory.PRECISIONS), value=precision, description=_desc("precision"),
                                      **_style()),
        "offload": widgets.Dropdown(options=list(OFFLOADS), value=offload, description=_desc("offload"), **_style()),
        "grad_accum": widgets.BoundedIntText(value=grad_accum, min=1, max=100_000,
                                             description=_desc("grad accumulation"), **_style()),
        "seq_len": widgets.BoundedIntText(value=seq_len, min=0, max=10_000_000, description=_desc("sequence"),
                                          **_style()),
        "micro_batch": widgets.BoundedIntText(value=micro_batch, min=1, max=100_000, description=_desc("micro-batch"),
                                              **_style()),
        "recompute": widgets.Dropdown(options=["full", "none"], value=recompute, description=_desc("recompute"),
                                      **_style()),
        "gpu_gb": widgets.BoundedFloatText(value=gpu_gb, min=0, max=10_000, description=_desc("GPU GB"), **_style()),
    }

    def convert(kw: dict) -> dict:
        oo, op = OFFLOADS[kw.pop("offload")]
        return {"psi": kw.pop("billions") * 1e9, **kw, "offload_optimizer": oo, "offload_param": op}

    def title(kw: dict) -> str:
        return (f"{kw['psi'] / 1e9:g}B parameters, N = {kw['world_size']}, {kw['precision']}: "
                "bytes per rank (* = selected)")

    return Calculator(controls, calculator_text, convert, summary=calculator_summary, bars=calculator_bars,
                      chart_title=title)


def planner_widget(model: str = "7B", gpus: int = 8, gpus_per_node: int = 8, gpu_memory_gb: float = 80.0,
                   intra: str | planner.Link = planner.INTRA_DEFAULT, inter: str | planner.Link = planner.INTER_DEFAULT,
                   precision: str = "bf16", micro_batch: int = 1, seq_len: int = 2048) -> Calculator:
    """zeroedu.planner.plan over presets and cluster settings; shows format_plan's table.

    intra / inter: a link name from planner.LINKS, or a Link (e.g. planner.calibrate(...) of collectives timed
    on your cluster), which joins the link menus under its name."""
    links = [(name, name) for name in sorted(planner.LINKS)]
    links += [(lk.name, lk) for lk in {id(x): x for x in (intra, inter) if isinstance(x, planner.Link)}.values()]
    controls = {
        "model": widgets.Dropdown(options=list(planner.PRESETS), value=model, description=_desc("model"), **_style()),
        "gpus": widgets.BoundedIntText(value=gpus, min=1, max=1_000_000, description=_desc("GPUs"), **_style()),
        "gpus_per_node": widgets.BoundedIntText(value=gpus_per_node, min=1, max=1024,
                                                description=_desc("GPUs per node"), **_style()),
        "gpu_memory_gb": widgets.BoundedFloatText(value=gpu_memory_gb, min=1, max=10_000, description=_desc("GPU GB"),
                                                  **_style()),
        "intra": widgets.Dropdown(options=links, value=intra, description=_desc("intra-node"), **_style()),
        "inter": widgets.Dropdown(options=links, value=inter, description=_desc("inter-node"), **_style()),
        "precision": widgets.Dropdown(options=list(theory.PRECISIONS), value=precision, description=_desc("precision"),
                                      **_style()),
        "micro_batch": widgets.BoundedIntText(value=micro_batch, min=1, max=100_000, description=_desc("micro-batch"),
                                              **_style()),
        "seq_len": widgets.BoundedIntText(value=seq_len, min=1, max=10_000_000, description=_desc("sequence"),
                                          **_style()),
    }
    return Calculator(controls, planner_text, summary=planner_summary)
