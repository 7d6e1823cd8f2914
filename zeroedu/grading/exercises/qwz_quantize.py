"""Exercise 8 (ex08_qwz_quantize): the learner's block quantizer, checked alone and inside the real engine's qwZ.

The check_* functions test quantize_blocks and dequantize_blocks on their own (block scales, a shorter last
block, blocks of zeros, the round trip). run_qwz trains stage 3 with qwZ on real gloo ranks
(zeroedu.grading.exercises.training) with the learner's functions for the int8 weights, next to the engine's own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from zeroedu.fmt import approx
from zeroedu.grading.exercises.ranks import not_implemented
from zeroedu.grading.exercises.stage3_gather import Stage3Run, _gathers
from zeroedu.grading.exercises.training import Case, dict_rel, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr

QUANT_CALLS = {"quantize": 0, "dequantize": 0}
QWZ_BLOCK = 64
"""The qwZ block size of the exercise's training runs (zeroedu's default is larger than a small model's units):
every unit's piece then spans several blocks and most end in a shorter one."""


class _LearnerQuantizer:
    """zeroedu.zeropp's quantizer with the learner's functions for qwZ's int8 weights (qgZ's int4 gradients keep the
    engine's), counting the calls."""

    def __init__(self, quantize: Callable, dequantize: Callable) -> None:
        from zeroedu.engine.extras import zeropp

        self.quantize_blocks, self.dequantize_blocks, self.engine = quantize, dequantize, zeropp.BlockQuantizer()

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if bits != 8:
            return self.engine.quantize(x, bits, block)
        QUANT_CALLS["quantize"] += 1
        codes, scales = self.quantize_blocks(x, block)
        if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.shape != x.shape:
            got = (f"{codes.dtype}{list(codes.shape)}", f"{scales.dtype}{list(scales.shape)}", list(x.shape))
            raise TypeError(tr(f"quantize_blocks returned codes {got[0]} and scales {got[1]} for an input of shape "
                               f"{got[2]}; return int8 codes shaped like the input and float32 scales",
                               f"对形状为 {got[2]} 的输入，quantize_blocks 返回的 codes 是 {got[0]}，scales 是 "
                               f"{got[1]}；codes 要返回与输入同形的 int8，scales 要返回 float32"))
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        QUANT_CALLS["dequantize"] += 1
        return self.dequantize_blocks(codes, scales, block)


def _qwz_engine(quantize: Callable, dequantize: Callable) -> Callable[[Case], type]:
    return functools.partial(_qwz_class, quantize, dequantize)


def _qwz_class(quantize: Callable, dequantize: Callable, case: Case) -> type:
    from zeroedu.compose import engine_class
    from zeroedu.config import load_config
    from zeroedu.engine.extras import zeropp

    zeropp.WEIGHT_BITS, zeropp.WEIGHT_BLOCK = 8, QWZ_BLOCK   # read by the engine when it is built
    base = engine_class(load_config(case.config(3)))
    if case.engine != "yours":
        return base
    return type(f"{base.__name__}WithYourQuantizer", (base,), {"quantizer": _LearnerQuantizer(quantize, dequantize)})


def _quant_calls(engine: Any, case: Case) -> dict:
    calls = dict(QUANT_CALLS)
    QUANT_CALLS.update(quantize=0, dequantize=0)
    return {"quant_calls": calls}


class QwzRun(Stage3Run):
    def _pair(self, i: int) -> int | None:
        case = self.cases[i]
        return next((j for j, c in enumerate(self.cases) if c.engine == "zeroedu" and c.model == case.model and
                     c.world_size == case.world_size and c.zero == case.zero and c.precision == case.precision), None)

    def check_trains(self) -> None:
        """Training with your quantizer: the same losses and weights as the engine's own qwZ (to rounding of the
        codes), and losses within 2% of unquantized training in one process."""
        for i, case, j in self._yours_with_pair():
            calls = self.ranks[i][0]["quant_calls"]
            if not calls["quantize"] or not calls["dequantize"]:
                raise AssertionError(tr(f"{case.name}: your functions were never called (the engine no longer "
                                        "calls its quantizer: zeroedu.grading.exercises.qwz_quantize needs updating).",
                                        f"{case.name}：你的函数从未被调用（引擎不再调用它的量化器："
                                        "zeroedu.grading.exercises.qwz_quantize 需要更新）。"))
            mine = [sum(r["losses"][s] for r in self.ranks[i]) / case.world_size for s in range(case.steps)]
            theirs = [sum(r["losses"][s] for r in self.ranks[j]) / case.world_size for s in range(case.steps)]
            for step, (a, b, c) in enumerate(zip(mine, theirs, self.refs[i]["losses"], strict=True)):
                if not math.isfinite(a):
                    raise AssertionError(tr(f"{case.name}: the loss at step {step} is {a}: some weight decoded to "
                                            "nan or inf (a block of zeros divided by a zero scale?).",
                                            f"{case.name}：第 {step} 步的 loss 是 {a}：有权重解码成了 nan 或 inf"
                                            "（全零的块除以了为 0 的 scale？）。"))
                if not abs(a - b) <= 1e-3 * abs(b):   # NaN-safe
                    raise AssertionError(tr(f"{case.name}: the loss at step {step} is {a:.6f} with your quantizer, "
                                            f"{b:.6f} with the engine's: the weights the forward used differ (each "
                                            "block's scale is max|x| / 127 of that block).",
                                            f"{case.name}：第 {step} 步的 loss 用你的量化器是 {a:.6f}，用引擎的是 "
                                            f"{b:.6f}：forward 用到的权重不一样"
                                            "（每个块的 scale 是该块的 max|x| / 127）。"))
                if not abs(a - c) <= 2e-2 * abs(c):
                    raise AssertionError(tr(f"{case.name}: the loss at step {step} is {a:.6f}, unquantized training "
                                            f"gets {c:.6f}: more than 2% apart.",
                                            f"{case.name}：第 {step} 步的 loss 是 {a:.6f}，不量化的训练是 {c:.6f}："
                                            "相差超过 2%。"))
            d, worst = dict_rel(self.ranks[i][0]["weights"], self.ranks[j][0]["weights"])
            if d > 1e-3:
                raise AssertionError(tr(f"{case.name}: after {case.steps} steps the weights are {d:.2g} (relative) "
                                        f"away from the engine's own qwZ run, most of all {worst!r}: the forward "
                                        "computed with weights your functions decoded differently (each block's "
                                        "scale is max|x| / 127 of that block).",
                                        f"{case.name}：{case.steps} 步之后，权重与引擎自带 qwZ 的结果相差 {d:.2g}"
                                        f"（相对误差），差得最多的是 {worst!r}：forward 用的权重被你的函数解码成了"
                                        "不同的值（每个块的 scale 是该块的 max|x| / 127）。"))

    def check_bytes(self) -> None:
        """The parameter all-gathers send int8 codes plus one fp32 scale per block: the engine's own bytes."""
        for i, case, j in self._yours_with_pair():
            for step in range(case.steps):
                sa, sb = _gathers(self.ranks[i][0], step)[1], _gathers(self.ranks[j][0], step)[1]
                if sa != sb:
                    raise AssertionError(tr(f"{case.name}, step {step}: the parameter all-gathers sent {sa} bytes, "
                                            f"the engine's qwZ sends {sb}: one int8 per weight and 4 bytes per block.",
                                            f"{case.name}，第 {step} 步：参数 all-gather 发送了 {sa} 字节，引擎的 qwZ "
                                            f"发送 {sb} 字节：每个权重一个 int8，每个块另加 4 字节。"))

    def table(self) -> str:
        if self.error:
            return tr(f"{self.what} did not run: {self.error}", f"{self.what} 没有跑起来：{self.error}")
        lines = [f"{'run':<28} {'loss after each step':<26} {'parameter bytes sent by rank 0 in step 0':>42}"]
        for i, case in enumerate(self.cases):
            losses = [sum(r["losses"][s] for r in self.ranks[i]) / case.world_size for s in range(case.steps)]
            lines.append(f"{case.name:<28} {' '.join(approx(v, 5) for v in losses):<26} "
                         f"{_gathers(self.ranks[i][0], 0)[1]:>42}")
        ref = self.refs[0]["losses"]
        lines.append(f"{'one process, unquantized':<28} {' '.join(approx(v, 5) for v in ref):<26}")
        return "\n".join(lines)


def run_qwz(quantize: Callable, dequantize: Callable, cases: list[Case]) -> QwzRun:
    """Train stage 3 with qwZ on ranks, with your quantizer and with the engine's, next to an unquantized run."""
    what = getattr(quantize, "__name__", tr("your quantizer", "你的量化器"))
    for fn, args in ((quantize, (torch.ones(8), 4)), (dequantize, (torch.ones(8, dtype=torch.int8), torch.ones(2), 4))):
        stub = in_kernel(not_implemented, fn, *args)
        if stub is not None:
            return QwzRun(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_qwz_engine(quantize, dequantize), cases, what=what, extra=_quant_calls)
    return QwzRun(run.what, run.cases, run.ranks, run.refs, run.error)


def _blocks_sample(shape: tuple[int, ...], block: int, seed: int = 0) -> torch.Tensor:
    """Values whose blocks differ in size by four orders of magnitude, so one scale for all cannot pass."""
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    nb = math.ceil(n / block)
    size = torch.logspace(-3, 1, max(nb, 2))[:nb].repeat_interleave(block)[:n]
    return torch.randn(*shape, generator=g) * size


def _expected_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """max|x| / 127 of every block along the last dimension, block by block (a loop: the plain definition)."""
    n = x.shape[-1]
    out = [x[..., s:s + block].abs().amax(dim=-1) / 127 for s in range(0, n, block)]
    return torch.stack(out, dim=-1)


def _quantized(quantize: Callable, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    got = quantize(x.clone(), block)
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise AssertionError(tr(f"quantize_blocks returned {type(got).__name__}; return a tuple (codes, scales) "
                                "of two tensors",
                                f"quantize_blocks 返回了 {type(got).__name__}；"
                                "要返回由两个张量组成的元组 (codes, scales)"))
    codes, scales = got
    nb = math.ceil(x.shape[-1] / block)
    where = tr(f"quantize_blocks(x of shape {list(x.shape)}, block={block})",
               f"quantize_blocks（x 形状 {list(x.shape)}，block={block}）")
    if codes.dtype != torch.int8 or codes.shape != x.shape:
        raise AssertionError(tr(f"{where} returned codes of {codes.dtype}{list(codes.shape)}; return int8 codes "
                                "shaped like x: one byte per element is the point of qwZ.",
                                f"{where} 返回的 codes 是 {codes.dtype}{list(codes.shape)}；codes 要返回与 x 同形的 "
                                "int8：每个元素只占 1 字节，这正是 qwZ 的意义所在。"))
    if scales.dtype != torch.float32:
        raise AssertionError(tr(f"{where} returned {scales.dtype} scales; return float32 scales.",
                                f"{where} 返回的 scales 是 {scales.dtype}；scales 要返回 float32。"))
    if scales.shape != (*x.shape[:-1], nb):
        last = x.shape[-1] - (nb - 1) * block
        raise AssertionError(tr(f"{where} returned scales of shape {list(scales.shape)}; expected "
                                f"{[*x.shape[:-1], nb]}: one scale per block, ceil({x.shape[-1]} / {block}) = {nb} "
                                f"blocks" + (f", the last one holding only {last} elements." if last != block else "."),
                                f"{where} 返回的 scales 形状是 {list(scales.shape)}；应为 {[*x.shape[:-1], nb]}："
                                f"每个块一个 scale，共 ceil({x.shape[-1]} / {block}) = {nb} 个块"
                                + (f"，最后一块只有 {last} 个元素。" if last != block else "。")))
    return codes, scales


def check_block_scales(quantize: Callable, sizes: tuple = ((1024, 256), (12, 4), (8, 8), (6, 1))) -> None:
    """Whole blocks: int8 codes shaped like x, one fp32 scale per block equal to max|x| / 127 over the block, and
    codes that round x / scale to the nearest integer in [-127, 127]."""
    for n, block in sizes:
        x = _blocks_sample((n,), block)
        codes, scales = _quantized(quantize, x, block)
        _compare_scales(x, block, scales)
        _compare_codes(x, block, codes, scales)


def _compare_scales(x: torch.Tensor, block: int, scales: torch.Tensor) -> None:
    want = _expected_scales(x, block)
    bad = ~torch.isclose(scales, want, rtol=1e-5, atol=0)
    if bool(bad.any()):
        k = tuple(int(v) for v in bad.nonzero()[0])
        overall = float(x.abs().max()) / 127
        hint = (tr(" That is the scale of the whole tensor: each block needs its own.",
                   "这是整个张量的 scale：每个块要有自己的 scale。") if abs(float(scales[k]) - overall)
                <= 1e-6 * overall else "")
        if float(scales[k]) != 0 and abs(float(scales[k]) * 127 - float(want[k])) <= 1e-5 * float(want[k]):
            hint = tr(" It is 1/127 of what it should be: the scale is max|x| / 127, so that codes reach +-127.",
                      "它是正确值的 1/127：scale 是 max|x| / 127，这样 codes 才能用满 +-127。")
        first = k[-1] * block
        last = min(first + block, x.shape[-1]) - 1
        raise AssertionError(tr(f"block {k[-1]} (elements {first} to {last}"
                                f"{', row ' + str(k[0]) if len(k) > 1 else ''}) has scale {float(scales[k]):.6g}, "
                                f"expected max|x| over the block / 127 = {float(want[k]):.6g}.{hint}",
                                f"第 {k[-1]} 块（元素 {first} 到 {last}"
                                f"{'，第 ' + str(k[0]) + ' 行' if len(k) > 1 else ''}）的 scale 是 "
                                f"{float(scales[k]):.6g}，应为该块的 max|x| / 127 = {float(want[k]):.6g}。{hint}"))


def _compare_codes(x: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    per = scales.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]
    safe = torch.where(per > 0, per, torch.ones_like(per))
    exact = torch.where(per > 0, x / safe, torch.zeros_like(x))
    off = (codes.float() - exact).abs()
    bad = off > 0.5 + 1e-3
    if bool(bad.any()):
        k = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(tr(f"element {k[-1]}: x = {float(x[k]):.6g}, scale = {float(per[k]):.6g}, code "
                                f"{int(codes[k])}; round(x / scale) = {round(float(exact[k]))}. Codes are x / scale "
                                "rounded to the nearest integer (torch.round), then clamped to [-127, 127].",
                                f"第 {k[-1]} 个元素：x = {float(x[k]):.6g}，scale = {float(per[k]):.6g}，code 是 "
                                f"{int(codes[k])}；round(x / scale) = {round(float(exact[k]))}。code 是把 x / scale "
                                "四舍五入到最近的整数（torch.round），再截断到 [-127, 127]。"))


def check_last_block(quantize: Callable, sizes: tuple = ((300, 128), (13, 4), (1000, 256), (5, 8))) -> None:
    """A length that the block does not divide: the last, shorter block gets its own scale from its own elements."""
    for n, block in sizes:
        x = _blocks_sample((n,), block, seed=1)
        codes, scales = _quantized(quantize, x, block)
        _compare_scales(x, block, scales)
        _compare_codes(x, block, codes, scales)


def check_zero_blocks(quantize: Callable, dequantize: Callable) -> None:
    """A block of zeros gets scale 0 and codes 0, and decodes to exact zeros: no nan, no division by zero."""
    for n, block, zero in ((12, 4, slice(4, 8)), (10, 4, slice(8, 10)), (8, 8, slice(0, 8))):
        x = _blocks_sample((n,), block, seed=2)
        x[zero] = 0
        codes, scales = _quantized(quantize, x, block)
        k = zero.start // block
        if float(scales[k]) != 0 or bool((codes[zero] != 0).any()):
            overall = float(x.abs().max()) / 127
            why = (tr(" That is the scale of the whole tensor: each block needs its own, and a block of zeros gets 0.",
                      "这是整个张量的 scale：每个块要有自己的 scale，全零的块 scale 为 0。")
                   if abs(float(scales[k]) - overall) <= 1e-6 * overall else
                   tr(" Divide only where the scale is not 0 (torch.where), without adding an epsilon to the scale.",
                      "只在 scale 不为 0 的地方做除法（torch.where），不要给 scale 加 epsilon。"))
            raise AssertionError(tr(f"a block of zeros (block {k} of x with {n} elements, block={block}) got scale "
                                    f"{float(scales[k]):.3g} and codes {codes[zero].tolist()}; expected scale 0 and "
                                    f"codes 0.{why}",
                                    f"一个全零的块（{n} 个元素的 x 的第 {k} 块，block={block}）得到的 scale 是 "
                                    f"{float(scales[k]):.3g}，codes 是 {codes[zero].tolist()}；应为 scale 0、"
                                    f"codes 0。{why}"))
        back = dequantize(codes, scales, block)
        if not bool(torch.isfinite(back).all()) or bool((back[zero] != 0).any()):
            raise AssertionError(tr(f"dequantize_blocks decoded a block of zeros to {back[zero].tolist()}; it must "
                                    "give exact zeros (code 0 times scale 0).",
                                    f"dequantize_blocks 把全零的块解码成了 {back[zero].tolist()}；必须得到精确的 0"
                                    "（code 0 乘以 scale 0）。"))
        _compare_scales(x, block, scales)


def check_roundtrip(quantize: Callable, dequantize: Callable,
                    shapes: tuple = (((1000,), 256), ((4, 300), 128), ((3, 7), 4))) -> None:
    """dequantize(quantize(x)) is code x scale per element, within half a scale of x; rows (leading dimensions)
    are quantized and decoded independently, as the engine decodes every rank's message at once."""
    for shape, block in shapes:
        x = _blocks_sample(shape, block, seed=3)
        codes, scales = _quantized(quantize, x, block)
        _compare_scales(x, block, scales)
        back = dequantize(codes, scales, block)
        if not isinstance(back, torch.Tensor) or back.shape != x.shape or back.dtype != torch.float32:
            what = f"{back.dtype}{list(back.shape)}" if isinstance(back, torch.Tensor) else type(back).__name__
            raise AssertionError(tr(f"dequantize_blocks returned {what} for codes of shape {list(codes.shape)}; "
                                    "return float32 values shaped like the codes.",
                                    f"对形状为 {list(codes.shape)} 的 codes，dequantize_blocks 返回了 {what}；"
                                    "要返回与 codes 同形的 float32。"))
        per = scales.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]
        want = codes.float() * per
        if not torch.allclose(back, want, rtol=1e-6, atol=0):
            k = tuple(int(v) for v in (~torch.isclose(back, want, rtol=1e-6, atol=0)).nonzero()[0])
            raise AssertionError(tr(f"x of shape {list(x.shape)}, block={block}: element {list(k)} decoded to "
                                    f"{float(back[k]):.6g}, but its code {int(codes[k])} times its block's scale "
                                    f"{float(per[k]):.6g} is {float(want[k]):.6g}. Each element uses the scale of its "
                                    "own block (and its own row).",
                                    f"x 形状 {list(x.shape)}，block={block}：元素 {list(k)} 解码成了 "
                                    f"{float(back[k]):.6g}，但它的 code {int(codes[k])} 乘以所在块的 scale "
                                    f"{float(per[k]):.6g} 是 {float(want[k]):.6g}。每个元素要用自己所在块"
                                    "（以及所在行）的 scale。"))
        err = float(((back - x).abs() - per / 2).max())
        if not err <= 1e-6 * float(x.abs().max()):   # NaN-safe: a NaN decode fails
            raise AssertionError(tr(f"x of shape {list(x.shape)}, block={block}: an element decodes more than half "
                                    "a scale away from x.",
                                    f"x 形状 {list(x.shape)}，block={block}：有元素解码后与 x 相差超过半个 scale。"))
