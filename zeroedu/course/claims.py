# ruff: noqa: E501  -- the rules' 中文 strings: ruff counts a CJK character as two columns, and a bilingual
#   sentence cut mid-phrase to fit reads worse than a long line.
"""`zeroedu check-claims FILE`: check a ZeRO crib sheet (八股) claim by claim against zeroedu.theory.

Give it Markdown or plain text in 中文 or English. It finds the claims it knows how to check (bytes per parameter by
stage and precision, memory in GB for a model size and GPU count, communication of each stage against DDP and
against each other, what each collective sends, offload's cost and bandwidths, ZeRO++'s factors, gradient
accumulation), computes the truth with zeroedu.theory, and prints the sheet's own ❌ 原文 → ✅ 正确说法 table, in the
sheet's language, with the evidence and the numbers. Every sentence that looks like a claim but matches no rule is
listed as not checked: nothing is dropped silently.

    from zeroedu.course import claims
    found = claims.check_text(open("sheet.md").read())      # [Finding(quote, verdict, correct, evidence), ...]
    print(claims.render(found))                             # the table, in the sheet's language
    claims.widget()                                         # paste a sheet into a notebook, get the table

Rules, not a language model: regular expressions over the words Chinese engineers use (显存, 通信量, 倍, 字节/参数,
Φ and Ψ, 卡) and their English equivalents. A rule only grades what it can compute; a claim whose truth depends on
things theory does not decide (throughput percentages, advice) gets "partly" with what theory does decide, never
"wrong". Lines of the sheet's own "❌ wrong answer → ✅ correction" format are checked from the ✅ on: the ❌ part is
what the sheet itself rejects.

Communication is in the ZeRO paper's units (Rajbhandari et al. 2020, Sec. 7): Ψ 16-bit elements, i.e. 2Ψ bytes;
DDP's all-reduce is 2Ψ. DeepSpeed 0.19.8 all-reduces stages 1-2's buckets by default
(`use_multi_rank_bucket_allreduce`, 3Ψ; (2A+1)Ψ at stage 2 with A micro-steps), which the correct statement or the
evidence mentions where it changes the answer.

No torch here (theory only): it runs where torch is not installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from zeroedu import theory

__all__ = ["VERDICTS", "Finding", "check_file", "check_text", "language", "main", "render", "to_json", "widget"]

VERDICTS = ("right", "wrong", "partly", "not_checked")
GB = theory.GB
LABELS = {"zh": {"right": "✅ 对", "wrong": "❌ 错", "partly": "⚠️ 部分对", "not_checked": "未核对"},
          "en": {"right": "✅ right", "wrong": "❌ wrong", "partly": "⚠️ partly", "not_checked": "not checked"}}


@dataclass
class Finding:
    """One claim of the sheet: `quote` is its exact text (text[start:end]), `correct` the right statement with its
    number, `evidence` the formula behind it; both in the sheet's language."""

    quote: str
    verdict: str
    correct: str
    evidence: str
    start: int = -1
    end: int = -1
    rule: str = ""

    def record(self) -> dict[str, str]:
        return {"quote": self.quote, "verdict": self.verdict, "correct": self.correct, "evidence": self.evidence}


# -- reading the sheet ------------------------------------------------------------------------------------------
CJK = re.compile(r"[\u4e00-\u9fff]")
NUM = r"\d+(?:\.\d+)?"
PSI = "[ΨΦψφ]"
STAGE = re.compile(r"(?:ZeRO[-\s]?(?:Stage\s*|stage\s*)?|Stage\s*|stage[-\s]*|阶段\s*)([0-3])(?![0-9])")
MODEL = re.compile(rf"(?<![A-Za-z0-9.])({NUM})\s*B(?![A-Za-z0-9])")       # 7B, 70B, 7.5B (not 14GB)
GPUS = re.compile(r"(\d+)\s*(?:张\s*)?(?:卡|GPUs?|块\s*GPU|个\s*GPU|x\s*A100|x\s*H100)(?![A-Za-z])")
ACCUM = re.compile(r"(?:梯度累积|accumulation)\D{0,6}?(\d+)\s*(?:步|个\s*micro|steps?|micro)|"
                   r"(\d+)\s*(?:步|个)?\s*(?:梯度累积|accumulation steps?)")
SENT_END = re.compile(r"[。！？；\n]|(?<=[.!?;])\s+")
CLAUSE_END = re.compile(r"[，,。！？；;\n]")
CLAIMISH = re.compile(r"\d|[ΨΦ]|通信|显存|all-?gather|reduce-?scatter|all-?reduce|offload|卸载|ZeRO|Stage|吞吐|带宽|"
                      r"GPU|卡|batch|参数|梯度|分片|并行|\bTP\b|\bPP\b|communicat|memory|bandwidth|throughput|parallel|"
                      r"shard|parameter|gradient", re.I)
REJECTED = re.compile(r"❌")
ACCEPTED = re.compile(r"✅|→")


def language(text: str) -> str:
    """'zh' when Chinese characters are at least a tenth of the letters, else 'en'."""
    cjk = len(CJK.findall(text))
    latin = len(re.findall(r"[A-Za-z]", text))
    return "zh" if cjk and cjk * 10 >= cjk + latin else "en"


@dataclass
class Sentence:
    start: int
    end: int
    text: str
    para_start: int
    para_end: int


class Sheet:
    """The text, its language, its sentences, and what each position is about (stage, GPUs, model size)."""

    def __init__(self, text: str, lang: str | None = None) -> None:
        self.text = text
        self.lang = lang or language(text)
        self.stages = [(m.start(), int(m.group(1))) for m in STAGE.finditer(text)]
        self.sentences = list(self._sentences())

    def _sentences(self) -> Iterator[Sentence]:
        pos, item = 0, 0
        for line in self.text.splitlines(keepends=True):
            if not (line[:1].isspace() and line.strip()) or pos == 0:
                item = pos                  # an indented line continues the Markdown list item above it
            para = (item, pos + len(line.rstrip("\n")))
            body_start = para[0]
            if REJECTED.search(line) and ACCEPTED.search(line):   # "❌ wrong answer → ✅ fix": check the fix only
                cut = ACCEPTED.search(line, REJECTED.search(line).end())
                body_start = para[0] + (cut.end() if cut else len(line))
            start = body_start
            for m in list(SENT_END.finditer(self.text, body_start, para[1])) + [None]:
                end = m.start() if m else para[1]
                chunk = self.text[start:end]
                lead = len(chunk) - len(chunk.lstrip())
                chunk = chunk.strip()
                if chunk:
                    yield Sentence(start + lead, start + lead + len(chunk), chunk, *para)
                start = m.end() if m else end
            pos += len(line)

    def stage_at(self, s: Sentence, pos: int) -> int | None:
        """The stage a position speaks of: the last one named before it in its sentence, else the first one named
        in its paragraph (a paragraph that opens with "Stage 2（梯度分片）：" is about stage 2 throughout)."""
        before = [st for p, st in self.stages if s.start <= p < pos]
        if before:
            return before[-1]
        para = [st for p, st in self.stages if s.para_start <= p < min(s.para_end, pos)]
        return para[0] if para else None

    def clause(self, s: Sentence, a: int, b: int) -> tuple[int, int]:
        """[a, b) widened to whole clauses (between commas) inside its sentence."""
        start = s.start
        for m in CLAUSE_END.finditer(self.text, s.start, a):
            start = m.end()
        m = CLAUSE_END.search(self.text, b, s.end)
        end = m.start() if m else s.end
        while start < end and self.text[start].isspace():
            start += 1
        return start, end


def _factor(word: str) -> Fraction | str | None:
    """A spoken multiple: '2' -> 2, '1.5' -> 3/2, '一半'/'half' -> 1/2, '翻倍'/'twice' -> 2, '1/N', '2N' -> 'N'."""
    w = word.strip().lower().replace("×", "").strip()
    w = w if w in {"翻倍", "加倍"} else w.replace("倍", "").strip()
    if "n" in w:
        return "N"
    if w in {"一半", "half", "减半", "halves", "halved"}:
        return Fraction(1, 2)
    if w in {"翻倍", "两", "二", "double", "doubles", "twice", "加倍", "2x"}:
        return Fraction(2)
    if w in {"相同", "一样", "不变", "相等", "same", "equal"}:
        return Fraction(1)
    m = re.fullmatch(r"(\d+)\s*/\s*(\d+)", w)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = re.fullmatch(NUM, w.rstrip("x").strip())
    return Fraction(m.group(0)) if m else None


def _psi_coef(expr: str) -> Fraction | None:
    """The leading coefficient of Ψ in '2Ψ + Ψ/N', '3Ψ', 'Ψ/64' (terms over N dropped: they vanish for large N)."""
    total, found = Fraction(0), False
    for coef, div in re.findall(rf"({NUM})?\s*{PSI}\s*(?:/\s*(N|\d+))?", expr):
        found = True
        c = Fraction(coef) if coef else Fraction(1)
        if div == "N":
            continue
        total += c / int(div) if div else c
    return total if found else None


def _close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * abs(b) + 1e-12


def _f(x: float) -> str:
    """A number as people say it: 112, 1.5, 37.4, 0.875."""
    x = float(x)
    if abs(x - round(x)) < 1e-9:
        return f"{round(x):,}"
    return f"{x:.3g}" if abs(x) < 10 else f"{x:,.1f}"


# -- the rules ---------------------------------------------------------------------------------------------------
# A rule reads one sentence and returns findings: (match start, match end, verdict, (zh correct, en correct),
# (zh evidence, en evidence)). The quote is the span widened to whole clauses.
Hit = tuple[int, int, str, tuple[str, str], tuple[str, str]]
RULES: list[Callable[[Sheet, Sentence], list[Hit]]] = []


def rule(fn: Callable[[Sheet, Sentence], list[Hit]]) -> Callable[[Sheet, Sentence], list[Hit]]:
    RULES.append(fn)
    return fn


def _ratio_truth(stage: int, accum: int = 1) -> Fraction:
    """Bytes a GPU sends per optimizer step at `stage`, as a multiple of DDP's (paper): 1, 1, (A+1)/2, 3A/2."""
    return {0: Fraction(1), 1: Fraction(1), 2: Fraction(accum + 1, 2), 3: Fraction(3 * accum, 2)}[stage]


def _comm_evidence(stage: int, accum: int = 1) -> tuple[str, str]:
    vol = {s: theory.comm_volume_paper(s) for s in theory.STAGES}
    n = 64
    total = {s: theory.comm_bytes_per_step(n * 10**6, n, s, grad_accum=accum)["total"] for s in (0, stage)}
    measured = total[stage] / total[0]
    zh = (f"论文 Sec. 7：DDP 的 all-reduce = reduce-scatter + all-gather，每卡约 {vol[0]}Ψ 元素；Stage 1、2 拆成 "
          f"reduce-scatter 梯度 + all-gather 参数，仍是 {vol[1]}Ψ；Stage 3 前向、反向各 all-gather 一次再 reduce-scatter，"
          f"{vol[3]}Ψ。theory.comm_bytes_per_step（N = {n}，梯度累积 {accum}）：Stage {stage} / DDP = {_f(measured)}。")
    en = (f"ZeRO paper Sec. 7: DDP's all-reduce = reduce-scatter + all-gather, about {vol[0]}Ψ elements per GPU; stages "
          f"1-2 split it into a gradient reduce-scatter and a parameter all-gather, still {vol[1]}Ψ; stage 3 gathers in "
          f"the forward and again in the backward, then reduce-scatters: {vol[3]}Ψ. theory.comm_bytes_per_step (N = {n}, "
          f"accumulation {accum}): stage {stage} / DDP = {_f(measured)}.")
    if stage in (1, 2) and accum == 1:
        zh += "（DeepSpeed 0.19.8 默认 use_multi_rank_bucket_allreduce=true，对梯度桶做 all-reduce，实际是 3Ψ 个元素。）"
        en += " (DeepSpeed 0.19.8's default use_multi_rank_bucket_allreduce=true all-reduces the buckets: 3Ψ elements.)"
    elif stage == 2:
        zh += "（DeepSpeed 0.19.8 默认每个 micro-step 对梯度做 all-reduce：每个优化器步 (2A+1)Ψ。）"
        en += " (DeepSpeed 0.19.8's default all-reduces the gradients at every micro-step: (2A+1)Ψ per optimizer step.)"
    return zh, en


def _ratio_words(stage: int, accum: int) -> tuple[str, str]:
    r = _ratio_truth(stage, accum)
    acc_zh = f"（梯度累积 {accum} 步，每个优化器步）" if accum > 1 else ""
    acc_en = f" (accumulation {accum}, per optimizer step)" if accum > 1 else ""
    if r == 1:
        return (f"Stage {stage} 每步通信量与 DDP 相同{acc_zh}：2Ψ 个元素（论文的做法），是 DDP 的 1 倍",
                f"stage {stage} sends what DDP sends{acc_en}: 2Ψ elements (the paper's schedule), 1x DDP")
    return (f"Stage {stage} 每步通信量是 DDP 的 {_f(r)} 倍{acc_zh}（{_f(2 * r)}Ψ 对 2Ψ 个元素，论文的做法）",
            f"stage {stage} sends {_f(r)}x DDP's bytes{acc_en} ({_f(2 * r)}Ψ against 2Ψ elements, the paper's schedule)")


def _accum(s: Sentence) -> int:
    m = ACCUM.search(s.text)
    return int(m.group(1) or m.group(2)) if m else 1


DDP_RATIO = [
    re.compile(r"(?:通信量?|通信开销)[^，。；]{0,12}?DDP\s*的\s*(1/N|一半|两倍|\d+(?:\.\d+)?\s*倍|\d+\s*/\s*\d+)"),
    re.compile(r"(?:通信量?|通信开销)[^，。；]{0,8}?(翻倍|减半|加倍)"),
    re.compile(r"(?:通信量?|通信开销)[^，。；]{0,8}?(?:与|和|跟)\s*DDP\s*(相同|一样|相等)"),
    re.compile(r"(?:与|和|跟)\s*DDP\s*(?:的)?\s*通信量?\s*(?:也|完全)?(相同|一样|相等)"),
    re.compile(r"(?:sends?|communicat\w*|communication(?: volume)?)[^.;,]{0,30}?\b(\d+(?:\.\d+)?)\s*(?:x|×|times)\s+"
               r"(?:what\s+|the bytes of\s+|that of\s+)?DDP", re.I),
    re.compile(r"(?:sends?|communicat\w*)[^.;,]{0,30}?\b(1/N|half|twice)\b[^.;,]{0,12}?DDP", re.I),
    re.compile(r"communicat\w*[^.;,]{0,20}?\b(doubles|halves)\b", re.I),
    re.compile(r"(?:sends?|communicat\w*)[^.;,]{0,30}?\b(?:the\s+)?(same)\s+(?:as|bytes as)\s+DDP", re.I),
]


@rule
def stage_vs_ddp(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 2 通信量约 DDP 的一半', 'stage 3 sends 2x DDP', 'Stage 3 通信量翻倍'."""
    if ZEROPP.search(s.text) or re.search(r"跨节点|cross-node|inter-node", s.text, re.I):
        return []                 # ZeRO++'s cuts: the zeropp rule reads them
    hits = []
    for pattern in DDP_RATIO:
        for m in pattern.finditer(sheet.text, s.start, s.end):
            stage = sheet.stage_at(s, m.start())
            said = _factor(m.group(1))
            if stage is None or said is None:
                continue
            accum = _accum(s)
            truth = _ratio_truth(stage, accum)
            if said != "N" and _close(float(said), float(truth)):
                verdict = "right"
            elif stage in (1, 2) and accum == 1 and said == Fraction(3, 2):
                verdict = "partly"    # DeepSpeed's default all-reduce of the buckets, not the paper's ZeRO
            else:
                verdict = "wrong"
            hits.append((m.start(), m.end(), verdict, _ratio_words(stage, accum), _comm_evidence(stage, accum)))
    return hits


ZERO_COMM = re.compile(r"通信(?:开销|量)?\s*[：:]?\s*(?:几乎|基本)?(?:为零|是零|为 0|可以忽略|忽略不计)|"
                       r"(?:almost|nearly|essentially)\s+(?:zero|no|nothing)\b[^.;]{0,20}communicat|"
                       r"communicat\w*(?:\s+\w+){0,2}\s+(?:almost|nearly|essentially)\s+(?:zero|nothing|free)|"
                       r"no communication overhead", re.I)


@rule
def almost_no_communication(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 1 通信几乎为零': every stage sends at least DDP's 2Ψ."""
    hits = []
    for m in ZERO_COMM.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage is None:
            continue
        hits.append((m.start(), m.end(), "wrong", _ratio_words(stage, 1), _comm_evidence(stage)))
    return hits


LOW_COMM = re.compile(r"通信开销(?:确实|很|较|比较)?低|(?:low|small) communication(?: overhead)?|"
                      r"communication(?: overhead)? is (?:low|small)", re.I)


@rule
def low_communication(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 1 通信开销确实低': exactly DDP's, low only next to stage 3."""
    hits = []
    for m in LOW_COMM.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage in (0, 1, 2):
            zh, en = _ratio_words(stage, 1)
            hits.append((m.start(), m.end(), "partly", (zh + "：只是比 Stage 3 的 3Ψ 低", en + ": low only next to "
                                                      "stage 3's 3Ψ"), _comm_evidence(stage)))
    return hits


MORE_COMM = re.compile(r"通信量(?:会)?(?:增加|变大|上升|变多)|(?:communicates|sends) more|communication (?:grows|increases)",
                       re.I)


@rule
def zero_communicates_more(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'ZeRO 省显存，但通信量增加': only stage 3 (paper)."""
    hits = []
    for m in MORE_COMM.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage == 3:
            hits.append((m.start(), m.end(), "right", _ratio_words(3, 1), _comm_evidence(3)))
        else:
            hits.append((m.start(), m.end(), "partly",
                         ("按论文只有 Stage 3 通信更多：3Ψ 个元素，是 DDP 的 1.5 倍；Stage 1、2 与 DDP 相同（2Ψ），省显存不加通信"
                          "（DeepSpeed 0.19.8 默认对梯度 all-reduce，Stage 1、2 反而是 3Ψ）",
                          "in the paper only stage 3 sends more: 3Ψ elements, 1.5x DDP; stages 1 and 2 send DDP's 2Ψ: memory "
                          "for free (DeepSpeed 0.19.8's default all-reduce of the gradients makes stages 1-2 3Ψ)"),
                         _comm_evidence(3)))
    return hits


STAGE_VS_STAGE = [
    re.compile(r"(?:Stage|ZeRO[-\s]?)\s*([0-3])\s*(?:的)?\s*通信量?\s*(?:约|大约|大概)?(?:是|为)?\s*(?:Stage|ZeRO[-\s]?)\s*([0-3])"
               r"\s*的\s*([0-9.]*N|\d+(?:\.\d+)?|两|一半)\s*倍?"),
    re.compile(r"(?:stage|ZeRO-)\s*([0-3])\s+(?:sends|communicates|moves)[^.;]{0,20}?(?<![/)\w.])(\d+(?:\.\d+)?|\d*N)\s*(?:x|×|times)"
               r"\s+(?:what\s+|the bytes of\s+)?(?:stage|ZeRO-)\s*([0-3])", re.I),
]
DIFF_TIMES = re.compile(r"差\s*(\d+)\s*倍|(\d+)\s*(?:x|×|times)\s+(?:more|apart|difference)", re.I)


@rule
def stage_vs_stage(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 3 通信量约是 Stage 2 的 2N 倍', 'N=64 时差 128 倍': 1.5x at every N."""
    if re.search(r"梯度累积|accumulat|micro-?step", s.text, re.I):
        return []                 # with accumulation the ratio depends on A: stage_vs_ddp reads those
    hits = []
    for i, pattern in enumerate(STAGE_VS_STAGE):
        for m in pattern.finditer(sheet.text, s.start, s.end):
            a, b, said = (int(m.group(1)), int(m.group(2)), m.group(3)) if i == 0 else \
                (int(m.group(1)), int(m.group(3)), m.group(2))
            hits.append(_stage_pair(m.start(), m.end(), a, b, _factor(said)))
    named = sorted({st for p, st in sheet.stages if s.start <= p < s.end})
    if len(named) == 2:
        for m in DIFF_TIMES.finditer(sheet.text, s.start, s.end):
            hits.append(_stage_pair(m.start(), m.end(), named[1], named[0], _factor(m.group(1) or m.group(2))))
    return hits


def _stage_pair(a0: int, a1: int, hi: int, lo: int, said: Fraction | str | None) -> Hit:
    truth = Fraction(theory.comm_volume_paper(hi), theory.comm_volume_paper(lo))
    ok = said not in (None, "N") and _close(float(said), float(truth))
    n = 64
    sent = {st: theory.comm_bytes_per_step(n * 10**6, n, st)["total"] for st in (hi, lo)}
    return (a0, a1, "right" if ok else "wrong",
            (f"Stage {hi} 的通信量是 Stage {lo} 的 {_f(truth)} 倍，任何 N 都一样（{theory.comm_volume_paper(hi)}(N-1)/N·Ψ 对 "
             f"{theory.comm_volume_paper(lo)}(N-1)/N·Ψ 个元素，论文的做法）",
             f"stage {hi} sends {_f(truth)}x stage {lo}'s bytes at every N ({theory.comm_volume_paper(hi)}(N-1)/N·Ψ against "
             f"{theory.comm_volume_paper(lo)}(N-1)/N·Ψ elements, the paper's schedule)"),
            (f"ring 算法每卡发送 (N-1)/N 的张量，两边同乘 (N-1)/N，N 消掉了；theory.comm_bytes_per_step 在 N = {n}："
             f"{_f(sent[hi] / sent[lo])} 倍",
             f"a ring sends (N-1)/N of the tensor per GPU on both sides, so N cancels; theory.comm_bytes_per_step at "
             f"N = {n}: {_f(sent[hi] / sent[lo])}x"))


COLLECTIVE = re.compile(rf"(all-?gather|reduce-?scatter|all-?reduce|allreduce|allgather)\s*(?:参数|梯度|parameters?|"
                        rf"gradients?)?\s*(?:的)?\s*(?:通信量|通信|moves|sends|of)?\s*(?:约为|约|为|是|is|about)?\s*[:：=]?\s*((?:{NUM})?\s*{PSI}"
                        rf"(?:\s*/\s*(?:N|\d+))?)", re.I)


@rule
def collective_volume(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'梯度 reduce-scatter 通信量 Ψ/N': a ring sends (N-1)/N·Ψ per GPU; Ψ/N is what it keeps."""
    hits = []
    for m in COLLECTIVE.finditer(sheet.text, s.start, s.end):
        op = m.group(1).lower().replace("-", "")
        truth = 2 if op == "allreduce" else 1
        expr = m.group(2)
        coef = _psi_coef(expr)
        over_n = re.search(r"/\s*(N|\d+)", expr)
        ok = coef is not None and not over_n and coef == truth
        name = {"allreduce": "all-reduce", "allgather": "all-gather", "reducescatter": "reduce-scatter"}[op]
        n = 64
        sent = theory.ring_sent_bytes(name.replace("-", "_"), 2 * n * 10**6, n) / (2 * n * 10**6)
        hits.append((m.start(), m.end(), "right" if ok else "wrong",
                     (f"一次 ring {name} 每卡发送约 {truth}Ψ（精确为 {truth}(N-1)/N·Ψ 个元素）；Ψ/N 是每卡最后拿到的那一片，"
                      "不是发送量", f"a ring {name} sends about {truth}Ψ per GPU ({truth}(N-1)/N·Ψ elements); Ψ/N is the "
                      "piece a GPU ends with, not what it sends"),
                     (f"theory.ring_sent_bytes：N = {n} 时每卡发送张量的 {_f(sent)} 倍，是 Ψ/N 的 {_f(sent * n)} 倍",
                      f"theory.ring_sent_bytes: at N = {n} each GPU sends {_f(sent)} of the tensor, {_f(sent * n)}x Ψ/N")))
    return hits


TOTAL_VOLUME = [
    re.compile(rf"(?:Stage|ZeRO[-\s]?)\s*([0-3])\s*(?:的)?\s*通信量?\s*(?:约|为|是|=|[:：])?\s*((?:{NUM})?\s*{PSI}"
               rf"(?:\s*/\s*(?:N|\d+))?(?:\s*\+\s*(?:{NUM})?\s*{PSI}(?:\s*/\s*(?:N|\d+))?)*)"),
    re.compile(rf"(?:stage|ZeRO-)\s*([0-3])\s+(?:sends|moves|communicates)\s+(?:about\s+)?((?:{NUM})?\s*{PSI}"
               rf"(?:\s*/\s*(?:N|\d+))?(?:\s*\+\s*(?:{NUM})?\s*{PSI}(?:\s*/\s*(?:N|\d+))?)*)", re.I),
    re.compile(rf"(?:通信量|communication volume)\s*(?:是|为|约|约为|is|of)\s*((?:{NUM})?\s*{PSI}(?:\s*/\s*(?:N|\d+))?)(?![\s]*[+/])"),
    re.compile(rf"(?:总计|总共|合计|in total|totals?)\s*[:：=]?\s*((?:{NUM})?\s*{PSI}(?:\s*/\s*(?:N|\d+))?"
               rf"(?:\s*\+\s*(?:{NUM})?\s*{PSI}(?:\s*/\s*(?:N|\d+))?)*(?:\s*≈\s*(?:{NUM})?\s*{PSI})?)", re.I),
]


@rule
def stage_volume(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 3 通信量 2Ψ', '总计 2Ψ + Ψ/N ≈ 2Ψ': 2, 2, 2, 3 Ψ per step."""
    if re.search(r"显存|memory|模型状态|model states|字节/参数|bytes per param", s.text, re.I):
        return []        # Ψ here counts memory: the bytes-per-parameter rule reads it
    hits = []
    for i, pattern in enumerate(TOTAL_VOLUME):
        for m in pattern.finditer(sheet.text, s.start, s.end):
            if i < 2:
                stage, expr = int(m.group(1)), m.group(2)
            elif i == 2:
                stage, expr = sheet.stage_at(s, m.start()), m.group(1)
            else:
                stage, expr = sheet.stage_at(s, m.start()), m.group(1)
                expr = expr.split("≈")[-1]
            if stage is None:
                continue
            coef = _psi_coef(expr)
            truth = theory.comm_volume_paper(stage)
            ok = coef is not None and coef == truth and not re.search(r"/\s*\d+", expr)
            hits.append((m.start(), m.end(), "right" if ok else "wrong",
                         (f"Stage {stage} 每步每卡通信约 {truth}Ψ（{truth}(N-1)/N·Ψ 个 16-bit 元素，即 {2 * truth}Ψ 字节）",
                          f"stage {stage} sends about {truth}Ψ per GPU per step ({truth}(N-1)/N·Ψ 16-bit elements, "
                          f"{2 * truth}Ψ bytes)"), _comm_evidence(stage)))
    return hits


NO_PARAM_COMM = re.compile(r"(?:前向|forward)\s*[/、和与或]\s*(?:反向|backward)\s*(?:都)?(?:无|没有|不需要|不做|no)\s*(?:参数)?\s*"
                           r"(?:通信|communication)|no parameter communication in (?:the )?forward (?:or|and) backward",
                           re.I)


@rule
def no_parameter_communication(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'Stage 2：前向/反向无参数通信': literally right below stage 3; the parameters move after the step."""
    hits = []
    for m in NO_PARAM_COMM.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage is None:
            continue
        if stage == 3:
            hits.append((m.start(), m.end(), "wrong", ("Stage 3 前向、反向各 all-gather 一次参数（各约 Ψ）",
                                                      "stage 3 all-gathers the parameters in the forward and again in "
                                                      "the backward (about Ψ each)"), _comm_evidence(3)))
        else:
            step = "；但优化器步之后要 all-gather 更新后的参数（约 Ψ 个元素），所以总量仍是 2Ψ" if stage else ""
            step_en = "; but after the optimizer step it all-gathers the updated parameters (about Ψ elements): 2Ψ in all" \
                if stage else ""
            hits.append((m.start(), m.end(), "right", (f"Stage {stage} 的前向、反向确实不通信参数{step}",
                                                      f"stage {stage} indeed moves no parameters in forward or "
                                                      f"backward{step_en}"), _comm_evidence(stage)))
    return hits


EVERY_MICRO = re.compile(r"梯度累积[^。；]*?每(?:个\s*micro-?step|个微步|个\s*micro-?batch|步|次)?\s*都(?:要|会)?(?:做\s*)?"
                         r"\s*reduce-?scatter|reduce-?scatters? (?:at|on|in) every micro-?(?:step|batch)", re.I)
ACCUM_SAVES = re.compile(r"(?:调整|增大|加大|提高|增加|调大)?梯度累积(?:步数)?[^。；]*?(?:减少|降低)(?:通信频率|通信量|通信)|"
                         r"(?:more|raise|increase|larger)\s+(?:gradient\s+)?accumulation[^.;]*?(?:less|fewer|reduce|"
                         r"cuts?)[^.;]*?communicat", re.I)


@rule
def accumulation(sheet: Sheet, s: Sentence) -> list[Hit]:
    """Stage 2 reduce-scatters at every micro-step; more accumulation cuts bytes per sample, not per step."""
    hits = []
    for m in EVERY_MICRO.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage is None:
            continue
        ok = stage >= 2
        hits.append((m.start(), m.end(), "right" if ok else "wrong",
                     ("Stage 2、3 每个 micro-step 都 reduce-scatter（1/N 的梯度分片存不下完整梯度的累加；DeepSpeed 0.19.8 的 Stage 2 "
                      "默认做的是 all-reduce）；Stage 0、1 每个优化器步只通信一次", "stages 2 and 3 reduce-scatter at every "
                      "micro-step (a 1/N gradient shard cannot hold the full sum; DeepSpeed 0.19.8's stage 2 all-reduces "
                      "by default); stages 0 and 1 communicate once per optimizer step"),
                     _comm_evidence(stage, 4)))
    for m in ACCUM_SAVES.finditer(sheet.text, s.start, s.end):
        stage = sheet.stage_at(s, m.start())
        if stage is None:
            continue
        a = 16
        if stage in (0, 1):
            verdict = "right"
            zh = f"Stage {stage} 每个优化器步只通信一次：累积 A 步，每个样本的通信量降为 1/A（A = {a}：1/{a}）"
            en = f"stage {stage} communicates once per optimizer step: A micro-steps cut the bytes per sample to 1/A"
        elif stage == 2:
            verdict = "partly"
            per_micro = Fraction(a + 1, 2 * a)
            zh = (f"Stage 2 每个 micro-step 都 reduce-scatter，通信频率不降：每个优化器步 (A+1)Ψ 个元素，是 DDP 的 (A+1)/2 倍"
                  f"（A = {a}：{_f(_ratio_truth(2, a))} 倍）；按 micro-batch 平均是 DDP 单步的 (A+1)/2A = {_f(per_micro)}，"
                  f"确实降了，但最多降一半")
            en = (f"stage 2 reduce-scatters at every micro-step, so the frequency stays: per optimizer step (A+1)Ψ elements, "
                  f"(A+1)/2 x DDP ({_f(_ratio_truth(2, a))}x at A = {a}); per micro-batch (A+1)/2A = {_f(per_micro)} of "
                  f"one DDP step: fewer bytes per sample, at most half")
        else:
            verdict = "wrong"
            zh = "Stage 3 每个 micro-step 都 all-gather 两次、reduce-scatter 一次：每个样本的通信量不随累积步数下降"
            en = "stage 3 gathers twice and reduce-scatters at every micro-step: bytes per sample do not fall"
        hits.append((m.start(), m.end(), verdict, (zh, en), _comm_evidence(stage, a)))
    return hits


OFFLOAD_COMM = re.compile(r"(?:offload|卸载)(?:(?!不|没|未)[^。；])*?(?:减少|降低|缓解)(?:网络|跨卡|跨节点)?(?:通信压力|通信量|通信)|"
                          r"offload\w*(?:(?!\bnot\b|n't|never)[^.;])*?(?:reduces?|cuts?|lowers?|relieves?)[^.;]*?communicat",
                          re.I)


def _offload_numbers() -> tuple[float, float]:
    psi, n = 7 * 10**9, 8
    pcie = theory.offload_transfer_bytes_per_step(psi, n, 2, offload_optimizer="cpu")["host_device"] / GB
    return pcie, pcie * 3 / 2


@rule
def offload_does_not_cut_network(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'开启 offload 减少通信压力': offload moves states off the GPU, not bytes off the network."""
    paper, ds = _offload_numbers()
    return [(m.start(), m.end(), "wrong",
             ("卸载（offload）不减少网络通信量：集合通信的字节一个不少；它还要每卡每步经 PCIe 传梯度分片和参数分片，"
              "并在 CPU 上跑 Adam", "offload leaves the network bytes unchanged and adds PCIe copies of the gradient "
              "and parameter shards plus a CPU Adam step"),
             (f"theory.offload_transfer_bytes_per_step：7B、8 卡、Stage 2，每卡每步 PCIe {_f(paper)} GB（论文 4Ψ/N 字节；"
              f"DeepSpeed 先把梯度转成 fp32 再拷，约 6Ψ/N = {_f(ds)} GB），comm_bytes_per_step 不变",
              f"theory.offload_transfer_bytes_per_step: 7B, 8 GPUs, stage 2: {_f(paper)} GB of PCIe per GPU per step "
              f"(paper 4Ψ/N bytes; DeepSpeed casts gradients to fp32 first, about 6Ψ/N = {_f(ds)} GB); "
              "comm_bytes_per_step unchanged"))
            for m in OFFLOAD_COMM.finditer(sheet.text, s.start, s.end)]


PCIE = re.compile(rf"PCIe\s*([345])\.0\s*(?:x16)?[^0-9。；\n]{{0,16}}?({NUM})\s*GB/s", re.I)
HBM = re.compile(rf"(A100|H100)\s*(?:的)?(?:显存带宽)?\s*(?:约|大约|~|≈|about|is|at)?\s*({NUM})\s*TB/s", re.I)
PCIE_GBS = {"3": 8e9 * 16 * 128 / 130 / 8 / GB, "4": 16e9 * 16 * 128 / 130 / 8 / GB, "5": 32e9 * 16 * 128 / 130 / 8 / GB}
HBM_TBS = {"a100": (1.555, 2.039), "h100": (2.0, 3.35)}    # 40 GB / 80 GB A100; PCIe / SXM H100 (vendor sheets)


@rule
def bandwidths(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'PCIe 3.0 x16 约 16GB/s', 'A100 约 2TB/s'."""
    hits = []
    for m in PCIE.finditer(sheet.text, s.start, s.end):
        truth = PCIE_GBS[m.group(1)]
        ok = _close(float(m.group(2)), truth, 0.15)
        hits.append((m.start(), m.end(), "right" if ok else "wrong",
                     (f"PCIe {m.group(1)}.0 x16 每个方向约 {_f(truth)} GB/s", f"PCIe {m.group(1)}.0 x16 carries about "
                      f"{_f(truth)} GB/s each way"),
                     ("每 lane 8/16/32 GT/s × 16 lane × 128b/130b 编码 ÷ 8", "8/16/32 GT/s per lane x 16 lanes x 128b/130b "
                      "coding / 8")))
    for m in HBM.finditer(sheet.text, s.start, s.end):
        lo, hi = HBM_TBS[m.group(1).lower()]
        ok = lo * 0.95 <= float(m.group(2)) <= hi * 1.05
        hits.append((m.start(), m.end(), "right" if ok else "wrong",
                     (f"{m.group(1)} 显存带宽 {lo}-{hi} TB/s", f"{m.group(1)} memory bandwidth is {lo}-{hi} TB/s"),
                     ("NVIDIA 规格表（不同显存容量/形态）", "NVIDIA data sheets (by memory size and form factor)")))
    return hits


NVME_FASTER = re.compile(r"NVMe[^。；]*?(?:二级|第二级|second(?:ary)?\s+(?:offload\s+)?tier)|"
                         r"(?:优化(?!器)|加速|提速)[^。；]{0,10}NVMe|NVMe[^。；.]*?(?:更快|faster|speed(?:s)? up)", re.I)


@rule
def nvme_tier(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'用 NVMe 作为二级 offload 来优化': NVMe is a capacity tier, slower than host memory."""
    if not re.search(r"优化(?!器)|加速|提速|更快|optimi[sz]e|faster|speed", s.text, re.I):
        return []
    return [(m.start(), m.end(), "wrong",
             ("NVMe 是容量层（ZeRO-Infinity），只在 CPU 内存放不下时才用；它比 CPU 内存慢（一块 PCIe 4.0 NVMe 约 3.5-7 GB/s，"
              f"CPU 内存经 PCIe 4.0 x16 约 {_f(PCIE_GBS['4'])} GB/s），只会更慢，不是优化",
              "NVMe is a capacity tier (ZeRO-Infinity) for states that do not fit in CPU memory; it is slower than host "
              f"memory (one PCIe 4.0 NVMe drive 3.5-7 GB/s, host memory over PCIe 4.0 x16 {_f(PCIE_GBS['4'])} GB/s): it "
              "makes steps slower, not faster"),
             ("Rajbhandari et al. 2021 (ZeRO-Infinity)", "Rajbhandari et al. 2021 (ZeRO-Infinity)"))
            for m in NVME_FASTER.finditer(sheet.text, s.start, s.end)]


ZEROPP = re.compile(r"ZeRO\+\+|qwZ|hpZ|qgZ", re.I)
ZEROPP_FACTOR = re.compile(rf"(?:跨节点)?通信量?[^。；]{{0,16}}?(?:降到|降为|减少到|减到|为|是)\s*(?:ZeRO-?3\s*的)?\s*(1/\d+|{NUM}\s*倍|"
                           rf"{NUM}\s*{PSI}|一半)|(?:跨节点)?通信量?[^。；]{{0,10}}?(减半|减少\s*{NUM}\s*倍)|"
                           rf"(?:cuts?|reduces?)[^.;]{{0,30}}?(?:by\s+)?({NUM})\s*(?:x|×|times)|"
                           rf"(?:to|is)\s+(?:about\s+)?(1/\d+|{NUM}\s*{PSI}|half)\s+(?:of\s+)?(?:ZeRO-3|stage 3|plain)",
                           re.I)


def _zeropp_parts(text: str) -> dict[str, bool]:
    named = {k: bool(re.search(k, text, re.I)) for k in ("qwz", "hpz", "qgz")}
    return named if any(named.values()) else dict.fromkeys(named, True)


@rule
def zeropp(sheet: Sheet, s: Sentence) -> list[Hit]:
    """ZeRO++'s factors, its hpZ memory, and what it does not touch (offload's PCIe copies)."""
    if not ZEROPP.search(s.text):
        return []
    para = sheet.text[s.para_start:s.para_end]
    hits: list[Hit] = []
    full = theory.zeropp_volume_paper(True, True, True)
    if re.search(r"传输量|PCIe|transfers?\b", s.text, re.I) and re.search(r"offload|卸载", para, re.I):
        m = ZEROPP.search(sheet.text, s.start, s.end)
        hits.append((m.start(), s.end, "wrong",
                     ("ZeRO++ 量化的是 GPU 之间的集合通信（qwZ int8 权重、qgZ int4 梯度），不碰 offload 的 PCIe 拷贝",
                      "ZeRO++ quantizes the GPU-to-GPU collectives (qwZ int8 weights, qgZ int4 gradients); it does not "
                      "touch offload's host-device copies"),
                     ("Wang et al. 2023；theory.zeropp_comm_bytes 只算集合通信", "Wang et al. 2023; "
                      "theory.zeropp_comm_bytes counts collectives only")))
        return hits
    no_mem = re.search(r"hpZ[^。；.]*?(?:不占|不增加|没有|无|不需要)(?:额外)?显存|hpZ[^.;]*?(?:no|without) (?:extra|additional) "
                       r"(?:GPU )?memory", s.text, re.I)
    if no_mem:
        a = s.start + no_mem.start()
        psi = 70 * 10**9
        extra = theory.zeropp_comm_bytes(psi, 64, 8, hpz=True, precision="bf16")["hpz_secondary_bytes"] / GB
        hits.append((a, s.start + no_mem.end(), "wrong",
                     ("hpZ 在节点内多存一份二级参数分片：每卡多 2Ψ/g 字节（g = zero_hpz_partition_size，通常是每节点卡数）",
                      "hpZ keeps a secondary parameter shard inside the node: 2Ψ/g more bytes per GPU (g = "
                      "zero_hpz_partition_size, usually a node's GPUs)"),
                     (f"theory.zeropp_comm_bytes(hpz=True)['hpz_secondary_bytes']：70B、每节点 8 卡，每卡 {_f(extra)} GB",
                      f"theory.zeropp_comm_bytes(hpz=True)['hpz_secondary_bytes']: 70B in nodes of 8, {_f(extra)} GB "
                      "per GPU")))
    for m in ZEROPP_FACTOR.finditer(sheet.text, s.start, s.end):
        raw = next(g for g in m.groups() if g)
        parts = _zeropp_parts(s.text)
        truth = Fraction(theory.zeropp_volume_paper(parts["qwz"], parts["hpz"], parts["qgz"])).limit_denominator(64) / 3
        if re.search(PSI, raw):
            said = _psi_coef(raw) / 3 if _psi_coef(raw) is not None else None
        elif re.search(r"减少\s*\d|cut|reduc", m.group(0), re.I) and re.search(NUM, raw):
            said = 1 / Fraction(re.search(NUM, raw).group(0))
        else:
            said = _factor(raw)
        if said is None or said == "N":
            continue
        ok = _close(float(said), float(truth))
        on = "+".join(k for k, v in parts.items() if v)
        named = ZEROPP.search(sheet.text, s.start, m.start())
        hits.append((named.start() if named else m.start(), m.end(), "right" if ok else "wrong",
                     (f"开启 {on} 后跨节点通信量是 ZeRO-3 的 {_f(truth)}（{_f(3 * truth)}Ψ 对 3Ψ）",
                      f"with {on} the bytes crossing nodes are {_f(truth)} of ZeRO-3's ({_f(3 * truth)}Ψ against 3Ψ)"),
                     ("theory.zeropp_volume_paper：前向 all-gather 1（qwZ 0.5）+ 反向 all-gather 1（qwZ 0.5，hpZ 0）+ 梯度 1"
                      "（qgZ 0.25）", "theory.zeropp_volume_paper: forward gather 1 (qwZ 0.5) + backward gather 1 (qwZ 0.5, "
                      "hpZ 0) + gradients 1 (qgZ 0.25)")))
    if not hits and re.search(r"通信|communicat", para, re.I) and re.search(r"使用|用|use|enable", s.text, re.I) and \
            re.search(r"量化|分片|quantiz|hierarch|partition", s.text, re.I):
        m = ZEROPP.search(sheet.text, s.start, s.end)
        hits.append((m.start(), m.end(), "right",
                     (f"ZeRO++ 三项（qwZ、hpZ、qgZ）把 Stage 3 的跨节点通信量从 3Ψ 降到 {_f(full)}Ψ（{_f(3 / full)} 倍），"
                      "代价是量化误差和 hpZ 的 2Ψ/g 显存", f"ZeRO++ (qwZ, hpZ, qgZ) cuts stage 3's cross-node bytes from 3Ψ "
                      f"to {_f(full)}Ψ ({_f(3 / full)}x), at the price of quantization error and hpZ's 2Ψ/g of memory"),
                     ("Wang et al. 2023；theory.zeropp_volume_paper", "Wang et al. 2023; theory.zeropp_volume_paper")))
    return hits


ONEBIT = re.compile(r"1-?bit\s*(?:Adam|LAMB)|0/1\s*Adam", re.I)


@rule
def one_bit_adam(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'用 1-bit Adam 压缩梯度' as a fix for ZeRO's communication."""
    para = sheet.text[s.para_start:s.para_end]
    if not re.search(r"ZeRO|Stage", para, re.I):
        return []
    return [(m.start(), m.end(), "wrong",
             ("1-bit Adam 压缩的是完整动量的 all-reduce，要求每卡都有完整的优化器状态，和 ZeRO 的分片冲突（旧版 DeepSpeed 直接断言不能同时"
              "开）；DeepSpeed 0.19.8 已不再提供 1-bit Adam。ZeRO 的梯度压缩是 ZeRO++ 的 qgZ（int4 梯度）",
              "1-bit Adam compresses an all-reduce of the full momentum, which every rank must hold: it conflicts with "
              "ZeRO's sharding (older DeepSpeed asserted ZeRO off), and DeepSpeed 0.19.8 no longer ships it. ZeRO's "
              "gradient compression is ZeRO++'s qgZ (int4 gradients)"),
             ("deepspeed 0.19.8 runtime/config.py DEEPSPEED_OPTIMIZERS（没有 OneBitAdam，DeepSpeed PR #8490 删除了 1-bit 和 0/1 "
              "优化器）；Wang et al. 2023", "deepspeed 0.19.8 runtime/config.py DEEPSPEED_OPTIMIZERS (no OneBitAdam: DeepSpeed "
              "PR #8490 removed the 1-bit and 0/1 optimizers); Wang et al. 2023"))
            for m in ONEBIT.finditer(sheet.text, s.start, s.end)]


TP_PP_Z3 = re.compile(r"TP\s*\+\s*PP\s*\+\s*ZeRO[-\s]*(?:Stage\s*)?3", re.I)
PP_Z3 = re.compile(r"(?<!TP \+ )(?<!TP\+)(?:Pipeline Parallelism|流水线并行|\bPP\b)\s*\+\s*ZeRO[-\s]*(?:Stage\s*)?3", re.I)


@rule
def parallelism_recipes(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'TP + PP + ZeRO-3' (how torchtitan-style runs train; not DeepSpeed's PipelineEngine) and 'prefer PP + ZeRO-3'."""
    hits = []
    for m in TP_PP_Z3.finditer(sheet.text, s.start, s.end):
        hits.append((m.start(), m.end(), "partly",
                     ("TP 放节点内、数据并行分片跨节点没错；TP + PP + 分片数据并行是 torchtitan（FSDP2）和 Llama 3 的做法，但 DeepSpeed 的 "
                      "PipelineEngine 只接受 ZeRO-0/1，Megatron-DeepSpeed 跑的是 TP + PP + ZeRO-1",
                      "TP inside a node and sharded data parallelism across nodes is right, and TP + PP + sharded DP is "
                      "how torchtitan (FSDP2) and Llama 3 train; DeepSpeed's PipelineEngine takes ZeRO-0/1 only, so "
                      "Megatron-DeepSpeed runs TP + PP + ZeRO-1"),
                     ("deepspeed 0.19.8 runtime/pipe/engine.py：'ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                      "parallelism'", "deepspeed 0.19.8 runtime/pipe/engine.py: 'ZeRO-2 and ZeRO-3 are incompatible "
                      "with pipeline parallelism'")))
    for m in PP_Z3.finditer(sheet.text, s.start, s.end):
        if any(a <= m.start() < b for a, b, *_ in hits):
            continue
        hits.append((m.start(), m.end(), "wrong",
                     ("流水线一步跑很多 micro-batch，Stage 3 每个 micro-batch 都要 all-gather 两次参数：DeepSpeed 的 PipelineEngine 断言 "
                      "ZeRO stage < 2；TP 和 ZeRO 用不同的进程组，可以叠加",
                      "a pipeline runs many micro-batches per step and stage 3 gathers twice at each: DeepSpeed's "
                      "PipelineEngine asserts ZeRO stage < 2; TP and ZeRO use different process groups and combine"),
                     ("deepspeed 0.19.8 runtime/pipe/engine.py 第 77 行的断言", "deepspeed 0.19.8 runtime/pipe/engine.py, "
                      "the assertion at line 77")))
    return hits


OPS = r"all-?gather|reduce-?scatter|all-?reduce|allreduce|allgather|broadcast"
USES = re.compile(rf"(?:通信模式是|只[^，。；,]{{0,10}}?(?:需要|用|做|进行)|(?:用|使用|通过|靠)\s*|(?:uses?|runs?|only needs?|communicates with|"
                  rf"pattern is)\s+(?:an?\s+|only\s+)?)\s*((?:{OPS})(?:\s*(?:和|与|、|\+|,|，|加|and|plus)\s*(?:an?\s+)?(?:{OPS}))*)",
                  re.I)
STAGE_OPS = {0: {"all-reduce"}, 1: {"reduce-scatter", "all-gather"}, 2: {"reduce-scatter", "all-gather"},
             3: {"all-gather", "reduce-scatter"}}


def _op(word: str) -> str:
    w = word.lower().replace("-", "")
    return {"allgather": "all-gather", "reducescatter": "reduce-scatter", "allreduce": "all-reduce"}.get(w, w)


@rule
def collectives_of_stage(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'ZeRO-1 用 all-gather 同步梯度', 'Stage 3 只需要 all-gather': which collectives each stage runs."""
    hits = []
    for m in USES.finditer(sheet.text, s.start, s.end):
        before = sheet.text[s.start:m.start()]
        if re.search(r"Tensor Parallel|\bTP\b|张量并行|模型并行|替代|instead of", before + sheet.text[m.end():m.end() + 6], re.I):
            continue                 # tensor parallelism's collectives, or "X instead of Y": not a stage's list
        stage = sheet.stage_at(s, m.start())
        if stage is None:
            continue
        named = {_op(w) for w in re.findall(OPS, m.group(1), re.I)}
        truth = STAGE_OPS[stage]
        only = bool(re.search(r"只|only", m.group(0), re.I))
        extra, missing = named - truth, truth - named
        what = sheet.text[m.end():m.end() + 40]
        c0, c1 = sheet.clause(s, m.start(), m.end())
        clause = sheet.text[c0:c1]
        if not re.search(r"参数|parameter|weight", clause, re.I):
            what += clause                           # '梯度用 all-gather 聚合': the object comes first
        if re.search(r"梯度|gradient", what, re.I) and named <= {"all-gather", "broadcast"}:
            extra = extra | {"all-gather (of gradients)"}          # gradients are reduced, never only gathered
        if re.search(r"参数|parameter|weight", what, re.I) and named == {"reduce-scatter"}:
            extra = extra | {"reduce-scatter (of parameters)"}
        if not extra and not (only and missing):
            verdict = "right"
        elif stage in (1, 2) and extra == {"all-reduce"} and not (only and missing - {"reduce-scatter"}):
            verdict = "partly"       # DeepSpeed 0.19.8's default all-reduces the gradient buckets
        else:
            verdict = "wrong"
        want = {0: ("all-reduce 梯度（= reduce-scatter + all-gather）", "an all-reduce of the gradients (= reduce-scatter + "
                    "all-gather)"),
                1: ("reduce-scatter 梯度，优化器步后 all-gather 参数", "a reduce-scatter of the gradients, then an "
                    "all-gather of the updated parameters"),
                2: ("每个桶 reduce-scatter 梯度，优化器步后 all-gather 参数", "a reduce-scatter per gradient bucket, then "
                    "an all-gather of the updated parameters"),
                3: ("前向、反向各 all-gather 一次参数，反向 reduce-scatter 梯度", "an all-gather of the parameters in the "
                    "forward and again in the backward, and a reduce-scatter of the gradients")}[stage]
        zh, en = f"Stage {stage}：{want[0]}", f"stage {stage}: {want[1]}"
        if stage in (1, 2):
            zh += "（DeepSpeed 0.19.8 默认 use_multi_rank_bucket_allreduce 对梯度桶做 all-reduce，再取自己那片）"
            en += " (DeepSpeed 0.19.8's default use_multi_rank_bucket_allreduce all-reduces each bucket and keeps its slice)"
        hits.append((m.start(), m.end(), verdict, (zh, en), _comm_evidence(stage)))
    return hits


THROUGHPUT = re.compile(r"(?:吞吐|throughput)[^。；]*?(?:下降|降低|损失|drops?|falls?|loses?|lower)\s*(?:by\s+)?(\d+)\s*"
                        r"(?:%\s*)?(?:-|–|~|到|至|to)\s*(\d+)\s*%", re.I)


@rule
def throughput_percent(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'吞吐下降 30-50%': theory decides bytes, not time; no fixed percentage exists."""
    hits = []
    for m in THROUGHPUT.finditer(sheet.text, s.start, s.end):
        para = sheet.text[s.para_start:s.para_end]
        offload = re.search(r"offload|卸载|PCIe", para, re.I)
        if offload:
            paper, ds = _offload_numbers()
            ev = (f"每卡每步 PCIe {_f(paper)} GB（7B、8 卡，论文 4Ψ/N；DeepSpeed 约 6Ψ/N = {_f(ds)} GB）加上 CPU 上整个节点的 Adam；"
                  "占计算时间的比例取决于 token 数、PCIe 代数、CPU 和是否重叠",
                  f"{_f(paper)} GB of PCIe per GPU per step (7B, 8 GPUs, paper 4Ψ/N; DeepSpeed about 6Ψ/N = {_f(ds)} GB) "
                  "plus the CPU's Adam over the node's whole share; its share of the step depends on tokens, PCIe "
                  "generation, CPU and overlap")
        else:
            ev = ("Stage 3 比 Stage 2 多一次参数 all-gather（3Ψ 对 2Ψ）；这一个 Ψ 要多少时间取决于网络带宽、每卡 token 数和预取重叠",
                  "stage 3 adds one parameter all-gather to stage 2 (3Ψ against 2Ψ); what that Ψ costs in time depends "
                  "on the network, the tokens per GPU and prefetching")
        hits.append((m.start(), m.end(), "partly",
                     (f"可能，但没有固定比例：{m.group(1)}-{m.group(2)}% 取决于集群和模型，理论只能给出多传的字节",
                      f"possible, but no fixed figure exists: {m.group(1)}-{m.group(2)}% depends on the cluster and the "
                      "model; theory gives the extra bytes"), ev))
    return hits


def _model_size(s: Sentence, before: int | None = None) -> tuple[float, int] | None:
    """The last model size ('7B', '70B') in the sentence before `before`: (parameters, position)."""
    found = [(float(m.group(1)) * 1e9, m.start()) for m in MODEL.finditer(s.text)
             if before is None or s.start + m.start() < before]
    return found[-1] if found else None


def _gpus(s: Sentence) -> int | None:
    m = GPUS.search(s.text)
    return int(m.group(1)) if m else None


def _stage_of(sheet: Sheet, s: Sentence, pos: int, default: int | None = 0) -> int | None:
    stage = sheet.stage_at(s, pos)
    if stage is None and re.search(r"DDP|数据并行|data parallel", s.text):
        return 0
    return default if stage is None else stage


def _memory_words(stage: int, psi: float, n: int) -> tuple[tuple[str, str], tuple[str, str], float]:
    gb = theory.model_state_bytes_paper(psi, n, stage) / GB
    coef = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[stage]
    size = f"{_f(psi / 1e9)}B"
    return ((f"{size} 模型、{n} 卡、Stage {stage}，混合精度 Adam 每卡模型状态 {coef} = {_f(gb)} GB",
             f"{size} on {n} GPU(s) at stage {stage}, mixed-precision Adam: {coef} = {_f(gb)} GB of model states per GPU"),
            ("每参数 2（16-bit 参数）+ 2（16-bit 梯度）+ 12（fp32 主权重 4 + 动量 4 + 方差 4）= 16 字节；"
             "theory.model_state_bytes_paper",
             "per parameter 2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master 4 + momentum 4 + variance 4) = 16 "
             "bytes; theory.model_state_bytes_paper"), gb)


TOTAL_GB = re.compile(rf"(?:总计|总共|一共|合计|共|total(?:s|ling)?|in all|每卡(?:模型状态|显存)?(?:约|为|是)?|per GPU|"
                      rf"模型状态(?:约|为|是)?|model states? of|keeps about|holds about|needs about)\s*[:：]?\s*(?:约|about)?\s*"
                      rf"({NUM})\s*GB", re.I)


@rule
def memory_total(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'7B 模型 FP16 … 总计 56GB', '13B 在 16 卡上 ZeRO-2 每卡 13 GB'."""
    hits = []
    for m in TOTAL_GB.finditer(sheet.text, s.start, s.end):
        size = _model_size(s, m.start())
        if size is None:
            continue
        psi, at = size
        stage = _stage_of(sheet, s, m.start())
        n = _gpus(s) or (1 if stage == 0 else None)
        if stage is None or n is None:
            continue
        said = float(m.group(1))
        words, ev, gb = _memory_words(stage, psi, n)
        pure = stage == 0 and _close(said, 8 * psi / GB)
        ok = _close(said, gb, 0.05)
        if pure and not re.search(r"纯\s*bf16|pure bf16|纯 16", s.text, re.I):
            words = (words[0] + f"；{_f(said)} GB 是纯 bf16（每参数 8 字节：无 fp32 主权重、动量方差为 bf16）的数，会丢掉小更新",
                     words[1] + f"; {_f(said)} GB is pure bf16 (8 B/param, no fp32 master, bf16 moments), which loses "
                     "small updates")
        end = m.end()
        fits = re.compile(r"[^。；]{0,30}?(?:勉强)?(?:能跑|放得下|装得下|fits?)").match(sheet.text, end, s.end)
        if fits:
            end = fits.end()
        hits.append((s.start + at, end, "right" if ok else "wrong", words, ev))
    return hits


OOM = re.compile(r"(?<![不没])(?<!不会)(?:直接|仍会|还是会|会)?(?<!不会)(?<![不没])(?:爆显存|放不下|装不下|OOM|out of memory|does not fit|doesn't fit|won't fit)", re.I)
GPU_MEM = re.compile(rf"(?:A100|H100|A800|H800|卡|GPU)\s*({NUM})\s*GB|({NUM})\s*GB\s*(?:的)?\s*(?:卡|GPU|A100|H100)", re.I)


@rule
def out_of_memory(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'13B 模型直接爆显存', 'Stage 1 对 70B 仍会爆显存'."""
    hits = []
    for m in OOM.finditer(sheet.text, s.start, s.end):
        size = _model_size(s, m.start())
        if size is None:
            continue
        psi, at = size
        stage = _stage_of(sheet, s, m.start())
        para = sheet.text[s.para_start:s.para_end]
        mem_m = GPU_MEM.search(s.text) or GPU_MEM.search(para)
        mem = float(mem_m.group(1) or mem_m.group(2)) if mem_m else 80.0
        n = _gpus(s)
        floor = {0: 16, 1: 4, 2: 2, 3: 0}[stage] * psi / GB      # N -> infinity
        need = theory.model_state_bytes_paper(psi, n, stage) / GB if n else floor
        if need <= mem and n is None:
            continue                              # more GPUs could make it fit: theory cannot say
        ok = need > mem
        how = f"{n} 卡" if n else "卡再多也至少"
        how_en = f"on {n} GPU(s)" if n else "at least, however many GPUs"
        hits.append((s.start + at, m.end(), "right" if ok else "wrong",
                     (f"{_f(psi / 1e9)}B 在 Stage {stage} 每卡模型状态 {how} {_f(need)} GB，{'超过' if ok else '低于'} {_f(mem)} GB",
                      f"{_f(psi / 1e9)}B at stage {stage} keeps {_f(need)} GB of model states per GPU ({how_en}), "
                      f"{'over' if ok else 'under'} {_f(mem)} GB"),
                     ("theory.model_state_bytes_paper：16Ψ、4Ψ + 12Ψ/N、2Ψ + 14Ψ/N、16Ψ/N（激活另算）",
                      "theory.model_state_bytes_paper: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (activations on top)")))
    return hits


FROM_TO = re.compile(r"(优化器状态|梯度|参数)\s*从\s*(\d+)\s*[×xX*]\s*参数量\s*[（(]\s*(FP32|FP16|BF16)\s*[）)]", re.I)
CATEGORY_BYTES = re.compile(rf"(?<!每)(?<!每个)(?<!per )(优化器状态|optimizer states?|梯度|gradients?|参数|parameters?|weights?)"
                            rf"\s*(?:的)?\s*(?:每(?:个)?参数|per parameter)?\s*(?:是|为|占|要|需要|约|大约|共|each|takes?|is|are|of|[:：])?"
                            rf"\s*(?:about\s+)?"
                            rf"({NUM})\s*(?:字节|bytes?)\s*(?:/\s*参数|每参数|per param(?:eter)?)?", re.I)
TRUE_BYTES = {"optimizer": 12, "gradient": 2, "parameter": 2}


def _category(word: str) -> str:
    w = word.lower()
    return "optimizer" if ("优化器" in w or "optimizer" in w) else "gradient" if ("梯度" in w or "gradient" in w) \
        else "parameter"


def _category_words(cat: str, said: float) -> tuple[tuple[str, str], tuple[str, str]]:
    truth = TRUE_BYTES[cat]
    zh_name = {"optimizer": "优化器状态", "gradient": "梯度", "parameter": "参数"}[cat]
    if cat == "optimizer":
        zh = "混合精度 Adam 的优化器状态每参数 K = 12 字节：fp32 主权重 4 + 动量 4 + 方差 4，Stage 1 起三项一起分片"
        en = ("mixed-precision Adam's optimizer state is K = 12 bytes per parameter: fp32 master 4 + momentum 4 + "
              "variance 4, all three sharded from stage 1")
        if said == 8:
            zh += "；8 字节漏了 fp32 主权重（三分之一）"
            en += "; 8 bytes leaves out the fp32 master weights (a third)"
    else:
        zh = f"{zh_name}每参数 {truth} 字节（fp16/bf16）"
        en = f"{cat}s take {truth} bytes per parameter (fp16/bf16)"
    return (zh, en), ("theory.optimizer_K('bf16') = 12；theory.param_bytes('bf16') = 2",
                      "theory.optimizer_K('bf16') = 12; theory.param_bytes('bf16') = 2")


@rule
def bytes_per_category(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'优化器状态从 2×参数量（FP32）', 'optimizer state is 8 bytes per parameter'."""
    hits = []
    for m in FROM_TO.finditer(sheet.text, s.start, s.end):
        cat = _category(m.group(1))
        said = int(m.group(2)) * theory.param_bytes(m.group(3).lower())
        words, ev = _category_words(cat, said)
        hits.append((m.start(), m.end(), "right" if said == TRUE_BYTES[cat] else "wrong", words, ev))
    if hits:
        return hits
    if re.search(r"通信|communicat|sends", s.text, re.I):
        return []
    for m in CATEGORY_BYTES.finditer(sheet.text, s.start, s.end):
        cat = _category(m.group(1))
        said = float(m.group(2))
        if re.search(r"fp32|FP32", m.group(0)) and cat != "optimizer":
            continue                                  # an fp32 copy of the weights or gradients: another question
        words, ev = _category_words(cat, said)
        hits.append((m.start(), m.end(), "right" if said == TRUE_BYTES[cat] else "wrong", words, ev))
    return hits


PER_PARAM = re.compile(rf"({NUM})\s*(?:字节\s*/\s*参数|字节每参数|B/param|bytes? per param(?:eter)?|bytes?/param)|"
                       rf"每(?:个)?参数\s*(?:的)?\s*(?:模型状态)?\s*(?:要|需要|占|是)?\s*({NUM})\s*(?:个)?字节|"
                       rf"((?:{NUM})?\s*{PSI}(?:\s*/\s*N)?(?:\s*\+\s*(?:{NUM})?\s*{PSI}(?:\s*/\s*N)?)*)", re.I)
STAGE_COEF = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


PART_WORDS = re.compile(r"冻结|frozen|LoRA|adapter|适配器|激活|activation|moments?\b|动量|方差|variance|master|主权重|buffer|缓冲|"
                        r"the base\b", re.I)
MEMORY_WORDS = re.compile(r"显存|模型状态|每卡|memory|model states?|per GPU|holds|keeps", re.I)
COMM_WORDS = re.compile(r"通信|每步|communicat|sends?\b|per step|all-?gather|reduce-?scatter|all-?reduce", re.I)


@rule
def bytes_per_parameter(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'混合精度 Adam 每参数 16 字节', 'ZeRO-2 每卡 2Ψ + 14Ψ/N', '16Φ'."""
    if not re.search(r"显存|模型状态|memory|model states?|字节|bytes", s.text, re.I) or COMM_WORDS.search(s.text):
        return []
    hits = []
    for m in PER_PARAM.finditer(sheet.text, s.start, s.end):
        a0, a1 = sheet.clause(s, m.start(), m.end())
        if m.group(3) and not MEMORY_WORDS.search(sheet.text[a0:a1]):
            continue                                 # a Ψ that is not said to be memory: not this rule's
        if m.group(3):
            expr = m.group(3)
            if not re.search(r"\d", expr):
                continue
            a = sum(Fraction(c or 1) for c, d in re.findall(rf"({NUM})?\s*{PSI}(\s*/\s*N)?", expr) if not d)
            b = sum(Fraction(c or 1) for c, d in re.findall(rf"({NUM})?\s*{PSI}(\s*/\s*N)?", expr) if d)
        else:
            a, b = Fraction(m.group(1) or m.group(2)), Fraction(0)
        if re.search(r"(?:优化器状态|梯度|optimizer states?|gradients?)[^，,。；]*$", sheet.text[s.start:m.start()], re.I):
            continue                                 # one category's bytes: bytes_per_category reads them
        if PART_WORDS.search(s.text):
            continue                                 # a part of the model states (frozen base, moments...)
        stage = _stage_of(sheet, s, m.start(), default=None)
        if stage is None:                            # no stage named: only the whole-model counts are safe to read
            if b or a not in (16, 18, 20):
                continue
            stage = 0
        if b == 0 and stage > 0 and not _gpus(s):
            continue                                 # "4 bytes" without N at stage >= 1: a part, not the total
        truth = STAGE_COEF[stage]
        said = (a, b)
        n = _gpus(s)
        if n and b == 0 and stage > 0:
            per = truth[0] + Fraction(truth[1], n)
            ok = _close(float(a), float(per))
        else:
            ok = said == truth
        verdict = "right" if ok else "wrong"
        form = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[stage]
        zh = f"Stage {stage} 混合精度 Adam 每卡模型状态 {form}（字节）"
        en = f"stage {stage}, mixed-precision Adam: {form} bytes of model states per GPU"
        if stage == 0 and not ok and a in (18, 20):
            verdict = "partly"
            zh += f"；{_f(a)} 字节只在开 fp32 梯度累积（data_types.grad_accum_dtype = fp32）时成立，DeepSpeed 0.19.8 默认用模型精度累积"
            en += (f"; {_f(a)} bytes holds only with fp32 gradient accumulation (data_types.grad_accum_dtype fp32); "
                   "DeepSpeed 0.19.8 accumulates in the model dtype by default")
        if stage == 0 and a == 8:
            zh += "；8 字节是纯 bf16（无 fp32 主权重）"
            en += "; 8 bytes is pure bf16 (no fp32 master)"
        hits.append((m.start(), m.end(), verdict, (zh, en),
                     ("论文 Sec. 5.1（Φ 和 Ψ 是同一个参数量）：2 + 2 + K，K = 12；theory.model_state_bytes_paper",
                      "ZeRO paper Sec. 5.1 (Φ and Ψ both name the parameter count): 2 + 2 + K, K = 12; "
                      "theory.model_state_bytes_paper")))
    return hits


SAVE_PCT = [
    re.compile(r"Stage\s*([0-3])\s*比\s*Stage\s*([0-3])\s*(?:节省|省|少(?:占)?)\s*(\d+)\s*%\s*(?:的)?\s*显存"),
    re.compile(r"stage\s*([0-3])\s+(?:saves|uses)\s+(\d+)\s*%\s+(?:less\s+)?memory\s+(?:over|than)\s+stage\s*([0-3])",
               re.I),
]
MORE_PCT = [
    re.compile(rf"Stage\s*([0-3])[^。；]*?比\s*Stage\s*([0-3])[^。；]*?显存多占\s*({NUM})\s*%"),
    re.compile(rf"stage\s*([0-3])\s+(?:uses|keeps|needs|takes)\s+({NUM})\s*%\s+more\s+memory\s+than\s+stage\s*([0-3])",
               re.I),
]


@rule
def memory_percent(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'在 4 卡上 Stage 2 比 Stage 1 节省 30% 显存', 'Stage 2 比 Stage 3 显存多占 30%'."""
    n = _gpus(s)
    if not n:
        return []
    hits = []
    for more, patterns in ((False, SAVE_PCT), (True, MORE_PCT)):
        for i, pattern in enumerate(patterns):
            for m in pattern.finditer(sheet.text, s.start, s.end):
                a, b, pct = (int(m.group(1)), int(m.group(2)), float(m.group(3))) if i == 0 else \
                    (int(m.group(1)), int(m.group(3)), float(m.group(2)))
                ma, mb = (theory.model_state_bytes_paper(1, n, st) for st in (a, b))
                truth = 100 * (ma / mb - 1) if more else 100 * (1 - ma / mb)
                ok = abs(pct - truth) <= 3
                word = ("多", "more") if more else ("少", "less")
                zh = f"{n} 卡时 Stage {a} 的模型状态比 Stage {b} {word[0]} {_f(truth)}%"
                en = f"at N = {n} stage {a} keeps {_f(truth)}% {word[1]} model state than stage {b}"
                if {a, b} <= {0, 1, 2} and re.search(r"通信|communicat", s.text, re.I):
                    zh += "；Stage 0、1、2 每步通信字节相同（2Ψ）"
                    en += "; stages 0, 1 and 2 send the same bytes per step (2Ψ)"
                comm = re.compile(r"[，,][^，,。；]*?(?:通信|communicat)[^，,。；]*").match(sheet.text, m.end(), s.end)
                hits.append((m.start(), comm.end() if comm else m.end(), "right" if ok else "wrong", (zh, en),
                             ("每参数 16、4 + 12/N、2 + 14/N、16/N 字节；theory.model_state_bytes_paper",
                              "16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter; theory.model_state_bytes_paper")))
    return hits


ONE_OVER_N = re.compile(r"每卡(?:只)?存\s*[“\"「]?\s*1/N|(?:each|every) GPU (?:holds|stores|keeps) (?:only )?1/N", re.I)


@rule
def everything_over_n(sheet: Sheet, s: Sentence) -> list[Hit]:
    """'ZeRO：显存从每卡存全量变为每卡存 1/N': only stage 3 reaches 1/N."""
    hits = []
    for m in ONE_OVER_N.finditer(sheet.text, s.start, s.end):
        if sheet.stage_at(s, m.start()) is not None or re.match(r"\s*的\s*(?:优化器|梯度|参数)|\s*of (?:the )?(?:optimizer|grad|param)",
                                                               sheet.text[m.end():m.end() + 12]):
            continue            # one stage's own category (stage 1's optimizer states): that is right
        hits.append((m.start(), m.end(), "partly",
                     ("只有 Stage 3 做到每卡 1/N（16Ψ/N）；Stage 1 是 4Ψ + 12Ψ/N，Stage 2 是 2Ψ + 14Ψ/N",
                      "only stage 3 reaches 1/N per GPU (16Ψ/N); stage 1 keeps 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N"),
                     ("theory.model_state_bytes_paper", "theory.model_state_bytes_paper")))
    return hits


# -- putting it together ---------------------------------------------------------------------------------------
def _claimish(text: str) -> bool:
    if len(text) < 6 or re.search(r"et al\.|\(\d{4}\)", text):
        return False
    return bool(CLAIMISH.search(text))


NEGATED = re.compile(r"不是|并非|不会|没有|不能|isn't|is not|\bnot\b|n't|\bnever\b", re.I)
QUESTION = re.compile(r"^\W*(?:为什么|怎么|什么|是否|如何|why|how|what|which|does|do|is|are|can)\b", re.I)


JUDGED = re.compile(r"[\"“「]([^\"”」\n]{4,200})[\"”」]\s*(?:is|are|was)?\s*(?:wrong|right|false|true|是错的|错在|不对|对吗|错)",
                    re.I)


def _question(sheet: Sheet, s: Sentence) -> bool:
    """A question asks; it claims nothing (its answer, on the next line, does)."""
    after = sheet.text[s.end:s.end + 1]
    return after in ("?", "？") or s.text.endswith(("?", "？")) or bool(QUESTION.match(s.text))


def check_text(text: str, lang: str | None = None) -> list[Finding]:
    """Every claim found in `text`, in order: the ones the rules grade, and the rest as not_checked."""
    if not isinstance(text, str):
        raise TypeError(f"check_text needs the sheet as a str, got {type(text).__name__}; read the file first "
                        "(check_file(path) does).")
    sheet = Sheet(text, lang)
    pick = 0 if sheet.lang == "zh" else 1
    found: list[Finding] = []
    judged = [(m.start(1), m.end(1)) for m in JUDGED.finditer(text)]     # "X" is wrong: X is quoted, not claimed
    for s in sheet.sentences:
        mine: dict[tuple[int, int], Finding] = {}
        for fn in RULES if not _question(sheet, s) else ():
            for a, b, verdict, correct, evidence in fn(sheet, s):
                start, end = sheet.clause(s, a, b)
                if NEGATED.search(text[start:b]) or any(qa <= a < qb for qa, qb in judged):
                    continue            # "不是 DDP 的一半", "does not reduce": the rule reads the claim the other way
                if any(f.start <= a < f.end and f.rule != fn.__name__ for f in mine.values()):
                    continue            # an earlier rule already read this part of the sentence
                key = (start, end)
                if key in mine:         # two numbers in one clause: one record, both checked
                    f = mine[key]
                    if f.verdict != verdict:
                        f.verdict = "partly" if "right" in (f.verdict, verdict) else "wrong"
                    if correct[pick] not in f.correct:
                        f.correct += ("；" if pick == 0 else "; ") + correct[pick]
                    if evidence[pick] not in f.evidence:
                        f.evidence += ("；" if pick == 0 else "; ") + evidence[pick]
                    continue
                mine[key] = Finding(text[start:end], verdict, correct[pick], evidence[pick], start, end, fn.__name__)
        covered = sorted(mine.values(), key=lambda f: f.start)
        found += covered
        found += _unchecked(sheet, s, covered)
    found.sort(key=lambda f: f.start)
    return found


def _unchecked(sheet: Sheet, s: Sentence, covered: list[Finding]) -> list[Finding]:
    """The claim-like clauses of a sentence that no rule read, as not_checked (one record per uncovered run)."""
    out, run = [], None
    pos = s.start
    for m in list(CLAUSE_END.finditer(sheet.text, s.start, s.end)) + [None]:
        end = m.start() if m else s.end
        a, b = pos, end
        while a < b and sheet.text[a].isspace():
            a += 1
        piece = sheet.text[a:b]
        free = not any(f.start < b and a < f.end for f in covered)
        if free and _claimish(piece):
            run = (run[0], b) if run else (a, b)
        elif run and not free:
            out.append(run)
            run = None
        pos = m.end() if m else end
    if run:
        out.append(run)
    zh = sheet.lang == "zh"
    return [Finding(sheet.text[a:b], "not_checked", "", "没有规则能核对这一句" if zh else "no rule can check this sentence",
                    a, b, "") for a, b in out]


def check_file(path: str | Path, lang: str | None = None) -> list[Finding]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file; give the Markdown or text file of the crib sheet.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text ({e.reason}); save the sheet as UTF-8 Markdown or text.") from None
    return check_text(text, lang)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(found: list[Finding], lang: str = "zh") -> str:
    """The ❌ 原文 → ✅ 正确说法 table (Markdown) of the graded claims, then the list of those not checked."""
    if lang not in LABELS:
        raise ValueError(f"lang must be 'zh' or 'en', got {lang!r}.")
    label = LABELS[lang]
    graded = [f for f in found if f.verdict != "not_checked"]
    head = ["❌ 原文", "判定", "✅ 正确说法", "证据"] if lang == "zh" else ["❌ the sheet says", "verdict",
                                                                  "✅ correct statement", "evidence"]
    lines = ["| # | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for i, f in enumerate(graded, 1):
        lines.append(f"| {i} | {_cell(f.quote)} | {label[f.verdict]} | {_cell(f.correct)} | {_cell(f.evidence)} |")
    counts = {v: sum(f.verdict == v for f in found) for v in VERDICTS}
    if lang == "zh":
        lines.append(f"\n共 {len(found)} 条：对 {counts['right']}，错 {counts['wrong']}，部分对 {counts['partly']}，"
                     f"未核对 {counts['not_checked']}。")
    else:
        lines.append(f"\n{len(found)} claims: {counts['right']} right, {counts['wrong']} wrong, {counts['partly']} "
                     f"partly, {counts['not_checked']} not checked.")
    rest = [f for f in found if f.verdict == "not_checked"]
    if rest:
        lines.append("\n" + ("未核对（没有规则能判断，请自己核对）：" if lang == "zh" else
                             "Not checked (no rule decides these; check them yourself):"))
        lines += [f"- {_cell(f.quote)}" for f in rest]
    return "\n".join(lines)


def to_json(found: list[Finding]) -> str:
    return json.dumps([f.record() for f in found], ensure_ascii=False, indent=1) + "\n"


def widget(text: str = "") -> object:
    """A notebook widget: paste a sheet, press the button, read the table. Returns the ipywidgets box."""
    import ipywidgets as w
    from IPython.display import Markdown, display

    box = w.Textarea(value=text, placeholder="粘贴八股 / paste a crib sheet", layout=w.Layout(width="100%",
                                                                                        height="160px"))
    button = w.Button(description="check · 核对")
    out = w.Output()

    def run(_: object = None) -> None:
        out.clear_output()
        with out:
            found = check_text(box.value)
            display(Markdown(render(found, language(box.value))))

    button.on_click(run)
    return w.VBox([box, button, out])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroedu check-claims", description="Check a ZeRO crib sheet's claims "
                                     "against zeroedu.theory: the ❌ 原文 → ✅ 正确说法 table, in the sheet's language.")
    parser.add_argument("file", type=Path, help="the sheet, Markdown or text, 中文 or English")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write one record per claim here")
    parser.add_argument("--lang", choices=("zh", "en"), help="the table's language (default: the sheet's)")
    args = parser.parse_args(argv)
    try:
        found = check_file(args.file)
    except (FileNotFoundError, ValueError) as e:
        print(f"zeroedu check-claims: {e}", file=sys.stderr)
        return 2
    text = args.file.read_text(encoding="utf-8")
    print(render(found, args.lang or language(text)))
    if args.json:
        args.json.write_text(to_json(found), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
