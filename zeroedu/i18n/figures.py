"""Figures that speak the notebook's language: `localize(fig)` rewrites a finished figure's words into Chinese
when `zeroedu.lang("zh")` is set, and leaves it alone otherwise.

Why after the fact: a lesson's code cells are the same in both editions, so a title a cell passes to a plot
(`title="Model states per rank, bf16 + Adam, N = 4"`) is English in both. Every plot of zeroedu.course.viz calls
`localize` on its figure before returning it, which looks each text of the figure up here: titles, axis labels,
legend entries, tick labels and annotations. An exact phrase is looked up first, then a pattern with numbers or
names in it; what is in neither stays English (`untranslated(fig)` lists it, so a test can keep the catalogue
complete). Numbers, stage names and collective names (all-reduce ...) are not translated, as Chinese engineers
write them (docs/zh/style.md).

matplotlib needs a font with Chinese glyphs: `localize` puts the common ones first in the sans-serif list (Noto
Sans CJK on Linux, PingFang on macOS, Microsoft YaHei on Windows) and warns once, with the fix, when none is
installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings

from zeroedu.i18n import current

CJK_FONTS = ["Noto Sans CJK SC", "Noto Sans CJK JP", "Source Han Sans SC", "PingFang SC", "Hiragino Sans GB",
             "Microsoft YaHei", "SimHei", "WenQuanYi Zen Hei", "Arial Unicode MS"]

PHRASES: dict[str, str] = {
    "theory": "理论值",
    "measured": "实测",
    "bound": "上界",
    "block": "块",
    "absolute error": "绝对误差",
    "time (ms)": "时间 (ms)",
    "time (s)": "时间 (s)",
    "optimizer step": "优化器步数",
    "loss (global batch)": "loss（全局 batch）",
    "the difference, magnified": "差值（放大）",
    "message size S (bytes)": "消息大小 S（字节）",
    "Ring reduce-scatter, step by step": "环形 reduce-scatter，逐步演示",
    "ms since the step started": "自本步开始的毫秒数",
    "backward waits for its collective": "反向等待集合通信",
    "What each rank does, over time": "每个 rank 随时间在做什么",
    "bytes per rank": "每个 rank 的字节数",
    "device -> host": "设备 → 主机",
    "host -> device": "主机 → 设备",
    "NVMe -> host": "NVMe → 主机",
    "host -> NVMe": "主机 → NVMe",
    "Adam on the host CPU": "主机 CPU 上的 Adam",
    "parameters": "参数",
    "gradients": "梯度",
    "master weights": "fp32 主权重",
    "optimizer state": "优化器状态",
    "buckets": "桶",
    "gathered parameters": "聚合出的参数",
    "activations": "激活值",
    "temporaries": "临时张量",
    "data-parallel ranks N": "数据并行 rank 数 N", "parameters + gradients": "参数 + 梯度",
    "other": "其他", "reference": "参考（单进程）", "bytes sent per rank": "每个 rank 发送的字节数",
    "largest |error| in the block (measured)": "块内最大 |误差|（实测）",
    "forward": "前向",
    "backward": "反向",
    "step": "优化器步",
    "init": "初始化",
    "Model states per rank, bf16 + Adam, N = 4": "每个 rank 的模型状态，bf16 + Adam，N = 4",
    "Per rank between steps, bf16 + Adam, N = 4": "两步之间每个 rank 的显存，bf16 + Adam，N = 4",
    "Per rank, bf16 + Adam, N = 4 (marker: model-state theory)":
        "每个 rank 的显存，bf16 + Adam，N = 4（标记：模型状态理论值）",
    "Bytes sent per rank per step, N = 4 (measured; marker: theory)":
        "每个 rank 每步发送的字节数，N = 4（柱：实测；标记：理论值）",
    "Bytes each rank sends per step, bf16, N = 4": "每个 rank 每步发送的字节数，bf16，N = 4",
    "Bytes each rank sends per step, as a multiple of DDP's (dashed line)":
        "每个 rank 每步发送的字节数，以 DDP 为 1 倍（虚线）",
    "Bytes per rank per optimizer step, fp32, N = 4 (stages 0 and 1 coincide)":
        "每个 rank 每个优化器步的字节数，fp32，N = 4（stage 0 与 stage 1 重合）",
    "Peak bytes in one bf16 step, one process (theory marker: model states)":
        "单进程一个 bf16 step 的峰值字节数（理论标记：模型状态）",
    "Peak bytes of one step at N = 8, rank 0 (marker: model states)":
        "N = 8 时 rank 0 一步的峰值字节数（标记：模型状态）",
    "Ring collectives on 4 gloo ranks (CPU, this machine)": "4 个 gloo rank 上的环形集合通信（CPU，本机）",
    "All-gather: complete chunks travel round the ring": "All-gather：完整的块沿环传一圈",
    "Reduce-scatter: which ranks' data each chunk sums (rows: ranks, columns: chunks)":
        "Reduce-scatter：每个块累加了哪些 rank 的数据（行：rank，列：块）",
    "Stage 0, overlap_comm=false: one step on 4 ranks": "Stage 0，overlap_comm=false：4 个 rank 上的一步",
    "Stage 0, overlap_comm=true: one step on 4 ranks": "Stage 0，overlap_comm=true：4 个 rank 上的一步",
    "Stage 3, DeepSpeed's default prefetch (5e7): gathers run ahead of the compute":
        "Stage 3，DeepSpeed 默认预取（5e7）：聚合跑在计算前面",
    "Stage 3, no prefetch: each gather waits until its module is about to run":
        "Stage 3，不预取：每次聚合等到模块即将运行时才开始",
    "TinyGPT, bf16, 4 ranks as 2 nodes of 2: where the bytes go":
        "TinyGPT，bf16，4 个 rank 分成 2 个节点×2：字节都去了哪里",
    "bytes sent per optimizer step": "每个优化器步发送的字节数",
    "gradient accumulation steps A": "梯度累积步数 A",
    "int8 blocks of TinyGPT's embedding, one outlier planted": "TinyGPT embedding 的 int8 块（埋入一个离群值）",
    "kB per optimizer step": "每个优化器步的 kB",
    "x stage 0 (DDP)": "× stage 0（DDP）",
    "bound max|x| / 2L": "上界 max|x| / 2L",
    "leaving a node (per node)": "流出一个节点（每个节点）",
    "within a node (per rank)": "节点内（每个 rank）",
    "Bytes leaving a node, per node: what the links between nodes carry":
        "每个节点流出的字节：节点间链路承载的量",
    "Bytes within a node, per rank": "节点内的字节，每个 rank",
}

PATTERNS: list[tuple[re.Pattern, str | None]] = [
    (re.compile(r"^(forward|backward|step)/(.+)$"), "{0}/{1}"),      # a ledger key: "backward/reduce-scatter"
    (re.compile(r"^(.+): measured$"), r"\1：实测"),
    (re.compile(r"^(.+): theory$"), r"\1：理论值"),
    (re.compile(r"^(.+): alpha-beta$"), r"\1：α-β 模型"),
    (re.compile(r"^compute: (.+)$"), "计算：{0}"),
    (re.compile(r"^collective: (.+)$"), r"集合通信：\1"),
    (re.compile(r"^after step (\d+)$"), r"第 \1 步之后"),
    (re.compile(r"^uninterrupted: stage (\d), (\d+) ranks$"), r"不中断：stage \1，\2 个 rank"),
    (re.compile(r"^load, continue at stage (\d), (\d+) ranks$"), r"加载后以 stage \1、\2 个 rank 继续"),
    (re.compile(r"^stage (\d), (\d+) ranks \(then save\)$"), r"stage \1、\2 个 rank（然后保存）"),
    (re.compile(r"^stage (\d) floor: (\S+) \((.+)\)$"), "stage {0} 下限：{1}（{2}）"),
    (re.compile(r"^block of (\d+) elements$"), r"每块 \1 个元素"),
    (re.compile(r"^Model states on the device, per rank \(N = (\d+), bf16\)$"),
     r"每个 rank 设备上的模型状态（N = \1，bf16）"),
    (re.compile(r"^Model states per rank \(bf16 \+ Adam, Psi = ([\d,]+)\): measured points, paper curves$"),
     r"每个 rank 的模型状态（bf16 + Adam，Ψ = \1）：点为实测，曲线为论文公式"),
    (re.compile(r"^(.+) \((\w+)\)$"), None),   # "bytes per rank (MB)": translate the words, keep the unit
]

_warned = False


def translate(text: str) -> str:
    """`text` in Chinese if the catalogue knows it (exactly, or by a pattern), else `text` unchanged."""
    key = text.strip()
    if key in PHRASES:
        return text.replace(key, PHRASES[key])
    for pattern, replacement in PATTERNS:
        match = pattern.match(text)
        if not match:
            continue
        if replacement is None:     # words with a unit in parentheses
            words = translate(match.group(1))
            return f"{words}（{match.group(2)}）" if words != match.group(1) else text
        if "{0}" in replacement:   # translate the captured words, keep the rest (collective names) as they are
            return replacement.format(*(PHRASES.get(g, g) for g in match.groups()))
        return match.expand(replacement)
    return text


def _texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_text()]


def use_cjk_font() -> None:
    """Put the installed fonts with Chinese glyphs first in matplotlib's sans-serif list (once a process)."""
    global _warned
    import matplotlib
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    found = [name for name in CJK_FONTS if name in installed]
    if not found:   # matplotlib's font cache predates the font (installed after its first run): add it now
        for path in font_manager.findSystemFonts():
            if re.search(r"cjk|pingfang|yahei|simhei|wqy|sourcehan", path, flags=re.I):
                with contextlib.suppress(Exception):
                    font_manager.fontManager.addfont(path)
        installed = {f.name for f in font_manager.fontManager.ttflist}
        found = [name for name in CJK_FONTS if name in installed]
    family = list(matplotlib.rcParams["font.sans-serif"])
    matplotlib.rcParams["font.sans-serif"] = found + [f for f in family if f not in found]
    if not found and not _warned:
        _warned = True
        warnings.warn("No font with Chinese glyphs for matplotlib: figure labels will show as boxes. Install one "
                      "(Debian/Ubuntu: sudo apt-get install fonts-noto-cjk; then restart the kernel); macOS and "
                      "Windows ship PingFang SC and Microsoft YaHei.", stacklevel=3)


def localize(fig):
    """Translate the words of a finished figure into the current language (Chinese, or nothing to do)."""
    if current() != "zh":
        return fig
    use_cjk_font()
    for text in _texts(fig):
        new = translate(text.get_text())
        if new != text.get_text():
            text.set_text(new)
    log = os.environ.get("ZEROEDU_I18N_LOG")    # translators: where the catalogue still misses a figure's words
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.writelines(f"{t}\n" for t in untranslated(fig))
    return fig


def untranslated(fig) -> list[str]:
    """The words of `fig` that are still English: letters and no catalogue entry (numbers and names pass)."""
    keep = re.compile(r"^\$|^[\d\s.,:%×x+\-−/()=≈]*$|^(all|reduce|broadcast|send|recv)[-_ a-z]*$|^stage \d|^N = \d|"
                      r"^rank \d|^batch \d|^[A-Za-z]?\d")
    return [t.get_text() for t in _texts(fig)
            if re.search(r"[A-Za-z]{3,}", t.get_text()) and not re.search(r"[\u4e00-\u9fff]", t.get_text())
            and not keep.search(t.get_text())]
