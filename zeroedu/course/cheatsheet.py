"""The one-page cheat sheet (速查表), English and 中文, rendered from zeroedu.theory so that its numbers cannot drift.

    python -m zeroedu.course.cheatsheet            write docs/cheatsheet.md and docs/cheatsheet.zh.md
    python -m zeroedu.course.cheatsheet --check    exit 1 if either file differs from what theory renders now

The book (`make book`) shows both pages and prints each to PDF. tests/test_cheatsheet.py checks every number on the
page against the closed forms written out by hand, and that the files on disk are the current rendering.
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from pathlib import Path

from zeroedu import theory

ROOT = Path(__file__).resolve().parents[2]
FILES = {"en": ROOT / "docs" / "cheatsheet.md", "zh": ROOT / "docs" / "cheatsheet.zh.md"}
WORLD_SIZES = (8, 64)
MODELS = (7e9, 70e9)
GPU_GB = 80
# Large enough that zeroedu's padding to a multiple of N is invisible in bytes per parameter.
_PSI = 64 * 10**6

T = {
    "title": ("# zeroedu cheat sheet: ZeRO in numbers", "# zeroedu 速查表：用数字记住 ZeRO"),
    "intro": (
        "Ψ = parameters, N = data-parallel ranks (GPUs), K = 12 optimizer bytes per parameter (mixed-precision "
        "Adam: fp32 master 4 + momentum 4 + variance 4). Every number below is rendered from `zeroedu.theory`; the "
        "course measures each one on live ranks.",
        "Ψ = 参数量（不少中文资料写作 Φ），N = 数据并行的 rank 数（卡数），K = 12 = 混合精度 Adam 每参数的优化器字节数"
        "（fp32 主权重 4 + 一阶动量 4 + 二阶动量 4）。下面每个数字都由 `zeroedu.theory` 生成，"
        "课程在真实的 rank 上逐一实测。"),
    "mem_h": ("## 1. Model-state memory per rank (bytes per parameter)", "## 1. 每卡模型状态显存（字节/参数）"),
    "mem_cols": (("stage", "what is sharded", "formula", *(f"N = {n}" for n in WORLD_SIZES)),
                 ("stage", "分片的内容", "公式", *(f"N = {n}" for n in WORLD_SIZES))),
    "sharded": (("nothing (DDP)", "optimizer states (P_os)", "+ gradients (P_os+g)", "+ parameters (P_os+g+p)"),
                ("无（DDP）", "优化器状态（P_os）", "+ 梯度（P_os+g）", "+ 参数（P_os+g+p）")),
    "comm_h": ("## 2. Communication per step per rank", "## 2. 每卡每步通信量"),
    "comm_note": (
        "The paper counts 16-bit **elements**: multiply by 2 for bytes in bf16/fp16. A ring sends (N-1)/N of "
        "each pass, so the exact bytes a rank sends are the paper's figure times (N-1)/N. DeepSpeed 0.19.8's "
        "defaults differ: stages 1-2 all-reduce the gradient buckets (`use_multi_rank_bucket_allreduce: true`), "
        "3Ψ elements, 1.5×; stage 3 keeps a small model gathered from forward to backward "
        "(`stage3_max_reuse_distance: 1e9`), about 2Ψ.",
        "论文以 16 位**元素**为单位：bf16/fp16 下乘以 2 才是字节。环形算法每一遍只发送 (N-1)/N，所以每个 rank "
        "实际发送的字节数是论文数字乘以 (N-1)/N。DeepSpeed 0.19.8 的默认值不同：Stage 1-2 对梯度桶做 all-reduce"
        "（`use_multi_rank_bucket_allreduce: true`），3Ψ 个元素，1.5×；Stage 3 把小模型从前向一直留到反向"
        "（`stage3_max_reuse_distance: 1e9`），约 2Ψ。"),
    "comm_cols": (("stage", "collectives in one step", "elements", "bytes (bf16)", "vs DDP"),
                  ("stage", "每步的集合通信", "元素", "字节（bf16）", "相对 DDP")),
    "collectives": (("all-reduce of gradients",
                     "reduce-scatter of gradients + all-gather of parameters",
                     "reduce-scatter of gradients (bucketed) + all-gather of parameters",
                     "all-gather in forward + all-gather in backward + reduce-scatter of gradients"),
                    ("梯度 all-reduce",
                     "梯度 reduce-scatter + 参数 all-gather",
                     "梯度 reduce-scatter（分桶）+ 参数 all-gather",
                     "前向 all-gather + 反向 all-gather + 梯度 reduce-scatter")),
    "ring_h": ("## 3. Ring collectives, exact bytes a rank sends for a tensor of S bytes",
               "## 3. 环形集合通信：S 字节的张量，每个 rank 实际发送的字节数"),
    "ring_cols": (("collective", "bytes sent", *(f"N = {n}" for n in WORLD_SIZES)),
                  ("集合通信", "发送字节数", *(f"N = {n}" for n in WORLD_SIZES))),
    "off_h": ("## 4. Offload (stage 2, optimizer on the CPU)", "## 4. 卸载（stage 2，优化器放在 CPU 上）"),
    "off_rows": (("device bytes per parameter", "host bytes per parameter",
                  "host-device bytes per parameter, one step"),
                 ("每参数的显存字节数", "每参数的主机内存字节数", "每步每参数的主机-设备传输字节数")),
    "formula": ("formula", "公式"),
    "off_note": (
        "The device keeps the 16-bit parameters; the host keeps the gradient shard in fp32 (4/N) and the optimizer "
        "states (K/N). The transfer row is the paper's: 16-bit gradient shard down, 16-bit parameter shard up. "
        "DeepSpeed 0.19.8 casts the gradient shard to fp32 on the device before the copy: (4 + 2)/N.",
        "设备上只留 16 位参数；主机上是 fp32 梯度分片（4/N）和优化器状态（K/N）。传输一行按论文计算："
        "16 位梯度分片下行，16 位参数分片上行。DeepSpeed 0.19.8 先在设备上把梯度分片转成 fp32 再拷贝：(4 + 2)/N。"),
    "zpp_h": ("## 5. ZeRO++: cross-node volume per step (paper units of Ψ elements)",
              "## 5. ZeRO++：每步跨节点通信量（论文单位：Ψ 个元素）"),
    "zpp_cols": (("ZeRO++ features", "volume", "vs ZeRO-3"), ("ZeRO++ 组件", "通信量", "相对 ZeRO-3")),
    "zpp_none": ("none (ZeRO-3)", "无（ZeRO-3）"),
    "ex_h": ("## 6. Worked examples: model states per GPU (GB = 10⁹ bytes; 80 GB GPUs)",
             "## 6. 例子：每卡模型状态（GB = 10⁹ 字节；80 GB 显卡）"),
    "ex_cols": (("model", "N", "stage 0", "stage 1", "stage 2", "stage 3"),
                ("模型", "N", "stage 0", "stage 1", "stage 2", "stage 3")),
    "ex_note": (
        "Marked ✗: over an {gpu} GB GPU before a single activation. Activations, buckets and temporary buffers "
        "come on top (notebooks 05, 11).",
        "标 ✗ 的：还没算激活值就已超过 {gpu} GB 显存。激活值、桶和临时缓冲区还要另算（第 05、11 课）。"),
}


def _t(key: str, lang: str):
    en, zh = T[key]
    return zh if lang == "zh" else en


def _table(cols, rows) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _fmt(x: float | Fraction) -> str:
    x = float(x)
    return f"{x:.0f}" if x == int(x) else f"{x:.3g}"


def bytes_per_param(stage: int, n: int) -> Fraction:
    """Model-state bytes per parameter per rank at `stage` on `n` ranks (bf16, Adam), from zeroedu.theory."""
    return Fraction(theory.model_state_bytes(_PSI, n, stage)["total"], _PSI)


FORMULAS = ("2 + 2 + K = 16", "2 + 2 + K/N", "2 + (2 + K)/N", "(2 + 2 + K)/N")
OFFLOAD_FORMULAS = ("2", "(4 + K)/N", "(2 + 2)/N")


def render(lang: str) -> str:
    lines = [_t("title", lang), "", _t("intro", lang), "", _t("mem_h", lang), ""]
    rows = [(s, _t("sharded", lang)[s], FORMULAS[s], *(_fmt(bytes_per_param(s, n)) for n in WORLD_SIZES))
            for s in theory.STAGES]
    lines += _table(_t("mem_cols", lang), rows)
    lines += ["", _t("comm_h", lang), "", _t("comm_note", lang), ""]
    ddp = theory.comm_volume_paper(0)
    rows = [(s, _t("collectives", lang)[s], f"{theory.comm_volume_paper(s)}Ψ",
             f"{2 * theory.comm_volume_paper(s)}Ψ", f"{_fmt(Fraction(theory.comm_volume_paper(s), ddp))}×")
            for s in theory.STAGES]
    lines += _table(_t("comm_cols", lang), rows)
    lines += ["", _t("ring_h", lang), ""]
    forms = {"all_reduce": "2(N-1)/N · S", "reduce_scatter": "(N-1)/N · S", "all_gather": "(N-1)/N · S"}
    rows = [(op.replace("_", "-"), form,
             *(f"{_fmt(Fraction(theory.ring_sent_bytes(op, 1024 * n, n), 1024 * n))} S" for n in WORLD_SIZES))
            for op, form in forms.items()]
    lines += _table(_t("ring_cols", lang), rows)
    lines += ["", _t("off_h", lang), ""]
    off = theory.offload_bytes(_PSI, WORLD_SIZES[0], 2, offload_optimizer="cpu")
    moved = theory.offload_transfer_bytes_per_step(_PSI, WORLD_SIZES[0], 2, offload_optimizer="cpu")
    cols = ("", _t("formula", lang), f"N = {WORLD_SIZES[0]}")
    values = (off["device"]["total"], off["host"]["total"], moved["host_device"])
    lines += _table(cols, [(name, form, _fmt(Fraction(v, _PSI)))
                           for name, form, v in zip(_t("off_rows", lang), OFFLOAD_FORMULAS, values, strict=True)])
    lines += ["", _t("off_note", lang), "", _t("zpp_h", lang), ""]
    base = theory.zeropp_volume_paper()
    combos = [(), ("qwZ",), ("hpZ",), ("qgZ",), ("qwZ", "hpZ", "qgZ")]
    rows = []
    for combo in combos:
        v = theory.zeropp_volume_paper(qwz="qwZ" in combo, hpz="hpZ" in combo, qgz="qgZ" in combo)
        ratio = Fraction(v).limit_denominator() / Fraction(base).limit_denominator()
        rows.append((" + ".join(combo) or _t("zpp_none", lang), f"{_fmt(v)}Ψ", f"{_fmt(ratio)}×"))
    lines += _table(_t("zpp_cols", lang), rows)
    lines += ["", _t("ex_h", lang), ""]
    rows = []
    for psi in MODELS:
        for n in WORLD_SIZES:
            cells = []
            for s in theory.STAGES:
                gb = theory.model_state_bytes_paper(psi, n, s) / theory.GB
                cells.append(f"{gb:.1f}" + (" ✗" if gb > GPU_GB else ""))
            rows.append((f"{psi / 1e9:.0f}B", n, *cells))
    lines += _table(_t("ex_cols", lang), rows)
    lines += ["", _t("ex_note", lang).format(gpu=GPU_GB), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zeroedu.course.cheatsheet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if a file differs from the current rendering")
    args = ap.parse_args(argv)
    stale = []
    for lang, path in FILES.items():
        text = render(lang)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}: run `python -m zeroedu.course.cheatsheet`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
