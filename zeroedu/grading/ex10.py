# ruff: noqa: E501  -- 中文 hints: ruff counts a CJK character as two columns
"""Test harness for exercise 10, "spot the errors": read a crib sheet's claims (unlabelled) and write, for each, the
sentence you would say in the interview: 对/错 (right/wrong) first, then the correct statement with its number, in
中文 or English.

    ANSWERS = {"A1": "错。Stage 3 每步发 3Ψ，DDP 是 2Ψ，所以是 1.5 倍，不是 2 倍。", ...}
    ex10.check_answers(ANSWERS, ex10.RUBRIC)

The grader reads each sentence, never runs it: `extract` finds the verdict word, the numbers it asserts (a number
in a clause that says 不是/not is one it rejects) and the key terms, and `check_answers` grades them against the
rubric, whose numbers are computed here from the papers' closed forms (written independently of zeroedu.theory).
A wrong number that matches a known misconception gets that misconception's hint ("2× is the sheet's error; stage
3 sends 1.5× DDP").

Under `zeroedu grade` the test cell runs in the grader's process and `ANSWERS` there is only a name for the
learner's object: `check_answers` then reads the dict literal from the answer cell's *source* in the notebook being
graded (string literals only, parsed with ast, never executed), so nothing the learner's kernel does decides the
score. The rubric of claims A4-A6 lives in the solution's hidden test cell, not in this module (which the learner's
kernel can import and read).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field

from zeroedu.grading import remote
from zeroedu.i18n import tr

Text = str | tuple[str, str]   # a hint in English, or (English, 中文): said in the learner's language

__all__ = ["ANSWER_CELL", "RUBRIC", "SHEET", "Expect", "answers_in_notebook", "check_answers", "expect", "extract",
           "grade_answer", "sheet_markdown"]

GB = 10**9
ANSWER_CELL = "ex10-answers"
STUB = ("ANSWERS: a dict from claim id to the sentence you would say: 对/错 (right/wrong) first, then the correct "
        "statement with its number", "ANSWERS：从说法编号到你会说的那句话的 dict：先写 对/错，再写正确的说法和它的数字")

# The sheet the learner reads: id -> (中文, English). No labels: which claims are wrong is the exercise.
SHEET: dict[str, tuple[str, str]] = {
    "A1": ("ZeRO-3 每步通信量是 DDP 的 2 倍：前向、反向各 all-gather 一次参数，再 reduce-scatter 一次梯度。",
           "ZeRO-3 sends 2x DDP's bytes per step: it all-gathers the parameters in the forward and again in the "
           "backward, then reduce-scatters the gradients."),
    "A2": ("13B 模型在 16 张卡上用 ZeRO-2，每卡模型状态约 13 GB（16Ψ/N）。",
           "13B on 16 GPUs with ZeRO-2 keeps about 13 GB of model states per GPU (16Ψ/N)."),
    "A3": ("ZeRO-1 开 8 步梯度累积，每个优化器步的通信量与 DDP 相同。",
           "ZeRO-1 with 8 accumulation steps sends what DDP sends per optimizer step."),
    "A4": ("ZeRO-Offload（Stage 2，7B，8 卡，bf16）每卡每步经 PCIe 传约 7 GB：fp32 梯度下去、fp32 参数回来。",
           "ZeRO-Offload (stage 2, 7B, 8 GPUs, bf16) moves about 7 GB per GPU per step over PCIe: fp32 gradients down, "
           "fp32 parameters back."),
    "A5": ("ZeRO++ 三项（qwZ、hpZ、qgZ）全开，跨节点通信量约为 ZeRO-3 的 1/4。",
           "With all of ZeRO++ (qwZ, hpZ, qgZ), the bytes crossing nodes are about 1/4 of ZeRO-3's."),
    "A6": ("hpZ 只改通信路径，不占额外显存（70B，每节点 8 卡）。",
           "hpZ only reroutes communication and costs no extra GPU memory (70B, nodes of 8 GPUs)."),
}


@dataclass(frozen=True)
class Expect:
    """What a correct answer to claim `id` says: the verdict, one of `numbers` (relative tolerance `tol`), every
    group of `terms` (any word of a group, in 中文 or English); `mistakes`: (number, hint) for misconceptions;
    `what`: the quantity the number is, for a generic hint that does not give the answer away. Hints and `what` are
    English or (English, 中文), said in the learner's language."""

    id: str
    verdict: str
    numbers: tuple[float, ...]
    what: Text
    terms: tuple[tuple[str, ...], ...] = ()
    mistakes: tuple[tuple[float, Text], ...] = field(default=())
    tol: float = 0.02


def _say(text: Text) -> str:
    return tr(*text) if isinstance(text, tuple) else text


def expect(id: str, verdict: str, numbers: tuple[float, ...] | float, what: Text, terms=(), mistakes=(),
           tol: float = 0.02) -> Expect:
    if verdict not in ("right", "wrong"):
        raise ValueError(f"verdict must be 'right' or 'wrong', got {verdict!r}")
    numbers = numbers if isinstance(numbers, tuple) else (numbers,)
    return Expect(id, verdict, tuple(float(n) for n in numbers), what, tuple(tuple(g) for g in terms),
                  tuple(mistakes), tol)


# -- the visible rubric (A1-A3), from the papers' closed forms -------------------------------------------------
def _model_states_gb(psi: float, n: int, stage: int) -> float:
    """The ZeRO paper's 2 + 2 + K bytes per parameter (K = 12), sharded by stage."""
    return (2 / (n if stage >= 3 else 1) + 2 / (n if stage >= 2 else 1) + 12 / (n if stage >= 1 else 1)) * psi / GB


RUBRIC = [
    expect("A1", "wrong", 1.5, ("stage 3's bytes per step as a multiple of DDP's", "ZeRO-3 每步通信字节数是 DDP 的几倍"),
           terms=[("all-gather", "allgather", "聚合参数", "gather")],
           mistakes=[(2.0, ("2× is the sheet's error; stage 3 sends 1.5× DDP: 3Ψ against DDP's 2Ψ (an all-reduce is "
                            "a reduce-scatter plus an all-gather, two passes)",
                            "2 倍正是原文的错误；ZeRO-3 的通信量是 DDP 的 1.5 倍：3Ψ 对 DDP 的 2Ψ（一次 all-reduce 就是一次 "
                            "reduce-scatter 加一次 all-gather，两趟）")),
                     (3.0, ("3× counts collectives, not bytes: DDP's one all-reduce is two passes (2Ψ), so stage 3's 3Ψ "
                            "is 1.5×",
                            "3 倍数的是集合通信的次数，不是字节：DDP 的一次 all-reduce 是两趟（2Ψ），所以 ZeRO-3 的 3Ψ 是 "
                            "1.5 倍"))]),
    expect("A2", "wrong", _model_states_gb(13e9, 16, 2), ("stage 2's model-state GB per GPU", "ZeRO-2 每卡模型状态的 GB 数"),
           mistakes=[(13.0, ("13 GB is 16Ψ/N, stage 3's formula: stage 2 keeps the 16-bit parameters whole, 2Ψ + 14Ψ/N",
                             "13 GB 是 16Ψ/N，那是 ZeRO-3 的公式：ZeRO-2 不切分 16 位参数，是 2Ψ + 14Ψ/N")),
                     (_model_states_gb(13e9, 16, 1), ("that is stage 1's 4Ψ + 12Ψ/N: stage 2 also shards the gradients",
                                                      "这是 ZeRO-1 的 4Ψ + 12Ψ/N：ZeRO-2 还会把梯度分片")),
                     (_model_states_gb(13e9, 16, 3), ("that is stage 3's 16Ψ/N: stage 2 keeps the 16-bit parameters whole",
                                                      "这是 ZeRO-3 的 16Ψ/N：ZeRO-2 不切分 16 位参数"))]),
    expect("A3", "right", (1.0, 2.0), ("stage 1's bytes per optimizer step against DDP's (1×, or 2Ψ)",
                                       "ZeRO-1 每个优化器步的通信字节数与 DDP 相比（1 倍，即 2Ψ）"),
           mistakes=[(8.0, ("stage 1 keeps the full gradient and reduces it once per optimizer step, like DDP: "
                            "accumulation does not multiply its bytes (stages 2 and 3 communicate every micro-step)",
                            "ZeRO-1 保留完整梯度，和 DDP 一样每个优化器步只归约一次：梯度累积不会成倍增加它的通信量"
                            "（ZeRO-2 和 ZeRO-3 每个 micro-step 都通信）")),
                     (4.5, ("(A + 1)/2 = 4.5× is stage 2 with 8 micro-steps; stage 1 reduces once per optimizer step",
                            "(A + 1)/2 = 4.5 倍是 ZeRO-2 在 8 个 micro-step 下的值；ZeRO-1 每个优化器步只归约一次"))]),
]


# -- reading a sentence -----------------------------------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)(?![\w.])|(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)|"
                    r"(一半|两倍|翻倍|双倍|half|twice|double)", re.I)
WORDS = {"一半": 0.5, "half": 0.5, "两倍": 2.0, "翻倍": 2.0, "双倍": 2.0, "twice": 2.0, "double": 2.0}
NEGATION = re.compile(r"不是|并非|而非|而不是|不到|不对|是错的|\bnot\b|\bisn't\b|\bnever\b|instead of|rather than", re.I)
NAMES = re.compile(r"(?:ZeRO[-\s]?(?:Stage\s*)?|Stage\s*|stage[-\s]*|阶段\s*)\d|(?<![\w.])\d+(?:\.\d+)?\s*B(?![A-Za-z])|"
                   r"PCIe\s*\d(?:\.\d)?|x16|(?:fp|bf|int)\d+", re.I)     # names with digits: not numbers said
CLAUSE = re.compile(r"[，,。；;：:！!？?\n]|\s+but\s+|但是?|而是|\s+-\s+")
VERDICT = [("partly", re.compile(r"^\W*(?:部分对|部分正确|半对|partly)", re.I)),
           ("wrong", re.compile(r"^\W*(?:错|不对|不正确|wrong|incorrect|false)", re.I)),
           ("right", re.compile(r"^\W*(?:对|正确|没错|right|correct|true)", re.I))]


@dataclass
class Parsed:
    verdict: str | None
    said: list[float]        # numbers the sentence asserts
    rejected: list[float]    # numbers in a clause that says "not"


def extract(sentence: str) -> Parsed:
    """The verdict word it starts with, the numbers it asserts and those it rejects (不是 2 倍 / not 2x)."""
    verdict = next((v for v, p in VERDICT if p.search(sentence)), None)
    said, rejected = [], []
    for clause in CLAUSE.split(NAMES.sub(" ", sentence)):
        out = rejected if NEGATION.search(clause) else said
        for m in NUMBER.finditer(clause):
            if m.group(1):
                out.append(float(m.group(1)) / float(m.group(2)) if float(m.group(2)) else math.inf)
            elif m.group(3):
                out.append(float(m.group(3).replace(",", "")))
            else:
                out.append(WORDS[m.group(4).lower()])
    return Parsed(verdict, said, rejected)


def _has(values: list[float], target: float, tol: float) -> bool:
    return any(math.isfinite(v) and abs(v - target) <= tol * abs(target) + 1e-9 for v in values)


def grade_answer(answer: object, rubric: Expect) -> list[str]:
    """What is wrong with one answer sentence ([] when it is right), each problem with its hint."""
    if not isinstance(answer, str) or not answer.strip() or "YOUR ANSWER" in answer:
        return [tr("no answer: write one sentence, 对/错 (right/wrong) first, with the number",
                   "还没有回答：写一句话，先写 对/错，再写数字")]
    p = extract(answer)
    problems = []
    if p.verdict is None:
        problems.append(tr("start with the verdict: 对 / 错 (right / wrong)", "先给出判断：对 / 错"))
    elif p.verdict != rubric.verdict:
        word = {"right": "对", "wrong": "错", "partly": "部分对"}[p.verdict]
        problems.append(tr(f"the claim is not {p.verdict}: check its number against the closed form",
                           f"这条说法不是“{word}”：用闭式公式核对它的数字"))
    if not any(_has(p.said, n, rubric.tol) for n in rubric.numbers):
        named = [hint for value, hint in rubric.mistakes if _has(p.said, value, 1e-3)]
        if named:
            problems.append(_say(named[0]))
        elif any(_has(p.rejected, n, rubric.tol) for n in rubric.numbers):
            problems.append(tr("you wrote the right number in a clause that says 不是/not: say it as what is true",
                               "你把正确的数字写在了带“不是”的分句里：把它当作正确的说法写出来"))
        else:
            problems.append(tr(f"say the number: {_say(rubric.what)}", f"写出数字：{_say(rubric.what)}"))
    text = answer.lower()
    for group in rubric.terms:
        if not any(word.lower() in text for word in group):
            problems.append(tr(f"name the mechanism: {' / '.join(group[:2])}", f"说出机制：{' / '.join(group[:2])}"))
    return problems


def answers_in_notebook(nb: object, cell_id: str = ANSWER_CELL) -> dict[str, str]:
    """The learner's ANSWERS, read from the source of the answer cell `cell_id` of a notebook: the dict literal
    assigned to ANSWERS (string values only), never executed."""
    cell = next((c for c in getattr(nb, "cells", []) if c.get("metadata", {}).get("nbgrader", {}).get("grade_id")
                 == cell_id), None)
    if cell is None:
        raise AssertionError(tr(f"the answer cell '{cell_id}' is missing from the notebook: restore it and write ANSWERS",
                                f"notebook 里缺少答案单元格 '{cell_id}'：把它恢复，再写 ANSWERS"))
    try:
        tree = ast.parse(cell.source)
    except SyntaxError as e:
        raise AssertionError(tr(f"the answer cell does not parse (line {e.lineno}: {e.msg}): fix it",
                                f"答案单元格无法解析（第 {e.lineno} 行：{e.msg}）：请修正")) from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ANSWERS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                raise AssertionError(tr("write ANSWERS as a dict of plain strings: {\"A1\": \"错。……\", ...} (no "
                                        "f-strings, calls or names: the grader reads the sentences, it does not run "
                                        "them)",
                                        "把 ANSWERS 写成只含普通字符串的 dict：{\"A1\": \"错。……\", ...}（不要用 f-string、"
                                        "函数调用或变量名：评分器只读这些句子，不运行它们）")) from None
            if not isinstance(value, dict):
                raise AssertionError(tr("ANSWERS must be a dict from claim id to your sentence",
                                        "ANSWERS 必须是从说法编号到你那句话的 dict"))
            return {str(k): v for k, v in value.items()}
    raise NotImplementedError(_say(STUB))


def _answers(answers: object) -> dict:
    """The learner's dict: in their own kernel, the object; under the grader (a proxy), read from the notebook."""
    if isinstance(answers, remote.Learner):
        link = remote.session()
        nb = getattr(getattr(link, "runner", None), "nb", None)
        if nb is None:
            raise AssertionError(tr("the grader could not read the notebook being graded", "评分器读不到正在评分的 notebook"))
        return answers_in_notebook(nb)
    if not isinstance(answers, dict):
        raise AssertionError(tr(f"ANSWERS must be a dict from claim id to your sentence, got {type(answers).__name__}",
                                f"ANSWERS 必须是从说法编号到你那句话的 dict，实际是 {type(answers).__name__}"))
    return answers


def check_answers(answers: object, rubric: list[Expect]) -> None:
    """Raise AssertionError naming every claim whose answer is wrong, with the hint for its misconception."""
    answers = _answers(answers)
    wrong = []
    for r in rubric:
        problems = grade_answer(answers.get(r.id), r)
        if problems:
            wrong.append(f"{r.id}: " + "; ".join(problems))
    assert not wrong, " | ".join(wrong)


def sheet_markdown(ids: list[str] | None = None) -> str:
    """The claims as a Markdown table: id, 中文, English."""
    rows = ["| # | 中文 | English |", "|---|---|---|"]
    rows += [f"| {i} | {SHEET[i][0]} | {SHEET[i][1]} |" for i in (ids or SHEET)]
    return "\n".join(rows)
