"""What the room got wrong: `zeroedu grade FOLDER --report report.md` (and report.zh.md, in 中文).

The tests' messages already say why an answer failed ("returned the sum, not the mean", "the ring schedule is off
by 1 step(s)", "That is the scale of the whole tensor"). CATALOGUE names the misconception behind each such
message, once, with the lesson section to revisit. The report counts learners, not failed tests: a learner whose
one mistake fails five checks counts once for it ("12 of 30 did not divide the reduce-scatter's sum by N"), out of
the learners who handed that exercise in. Failures no entry explains are ranked too, by check, so nothing a
learner got wrong is left out of the report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zeroedu.grading.results import ExerciseResult


@dataclass(frozen=True)
class Misconception:
    key: str
    pattern: str          # a regular expression searched in a failed test's message
    en: str
    zh: str
    revisit: str          # the lesson section, as notebooks/NN_name.ipynb § heading
    exercises: tuple[str, ...] = ()   # only these exercises' tests (prefixes); empty: any


CATALOGUE: tuple[Misconception, ...] = (
    Misconception("not-attempted", r"^not implemented yet|^尚未实现", "left an answer unwritten (NotImplementedError)",
                  "有答案单元格没有写（仍是 NotImplementedError）", "the exercise's own instructions"),
    Misconception("opt-not-divided",
                  r"partitions the optimizer[ _]states|your optimizer_states = "
                  r"|分片的是：优化器状态|会把 optimizer_states 分片|你算出的 optimizer_states = ",
                  "kept the whole optimizer states on every rank: stages 1-3 divide them by N",
                  "每卡保留了全部优化器状态：阶段 1-3 要把它们除以 N",
                  "notebooks/01_memory_anatomy.ipynb § 1, notebooks/04_stage1.ipynb § 3", ("ex01",)),
    Misconception("grads-not-divided", r"partitions the gradients|会把 gradients 分片",
                  "kept the whole gradients on every rank at stages 2-3", "阶段 2-3 每卡仍保留了全部梯度",
                  "notebooks/05_stage2.ipynb § 2", ("ex01",)),
    Misconception("params-not-divided", r"partitions the parameters|会把 parameters 分片",
                  "kept the whole parameters on every rank at stage 3", "阶段 3 每卡仍保留了全部参数",
                  "notebooks/06_stage3.ipynb § 2", ("ex01",)),
    Misconception("divided-too-early", r"does not partition the \w+ yet|还不分片 \w+",
                  "divided by N a state that this stage keeps whole", "把本阶段并不分片的状态也除以了 N",
                  "notebooks/01_memory_anatomy.ipynb § 1", ("ex01",)),
    Misconception("wrong-k", r"Check the bytes per parameter|检查每个参数的字节数",
                  "used the wrong bytes per element or K (K = 12 for mixed-precision Adam, 8 in plain fp32)",
                  "每个元素的字节数或 K 用错了（混合精度 Adam 的 K = 12，纯 fp32 为 8）",
                  "notebooks/01_memory_anatomy.ipynb § 2", ("ex01",)),
    Misconception("sum-not-mean",
                  r"returned the sum, not the mean|times too big \(divide by N\)|it is the sum over the \d+ ranks"
                  r"|返回的是总和而不是平均值|大了 \d+ 倍（要除以 N）|它是 \d+ 个 rank 的总和",
                  "summed the ranks' gradients without dividing by N (average = sum / N)",
                  "把各 rank 的梯度求和后没有除以 N（平均值 = 总和 / N）",
                  "notebooks/02_collectives.ipynb § 1, notebooks/05_stage2.ipynb § 1"),
    Misconception("ring-off-by-one", r"off by \d+ step|ring 的调度偏了",
                  "started the ring one step off (rank r must end holding chunk r)",
                  "ring 的起始块错了一步（rank r 最后应持有第 r 块）", "notebooks/02_collectives.ipynb § 2", ("ex02",)),
    Misconception("ring-index", r"raised IndexError|抛出了 IndexError",
                  "indexed past the last rank: ring neighbours wrap around (% N)",
                  "下标越过了最后一个 rank：ring 的邻居要取模（% N）", "notebooks/02_collectives.ipynb § 2", ("ex02",)),
    Misconception("deadlock", r"\bhung\b|deadlock|卡住了|死锁",
                  "ranks waited on each other forever: every send needs its matching receive",
                  "各 rank 互相等待（死锁）：每个 send 都要有对应的 recv", "notebooks/02_collectives.ipynb § 2"),
    Misconception("bucket-boundary", r"assign_buckets\(.*\) (?:returned|返回)",
                  "closed a bucket one gradient early: a bucket that is exactly full still takes that gradient",
                  "桶刚好装满时就提前关闭了：正好装满的桶仍要放入这个梯度", "notebooks/03_stage0_ddp.ipynb § 3",
                  ("ex03",)),
    Misconception("no-overlap", r"all-reduced only after backward had ended|直到 backward 结束后才做 all-reduce",
                  "reduced the buckets after backward instead of as each one fills (no overlap)",
                  "反向结束后才归约各个桶，而不是每个桶装满就归约（没有通信与计算重叠）",
                  "notebooks/03_stage0_ddp.ipynb § 4", ("ex03",)),
    Misconception("no-all-gather", r"only through the all-gather after the step|all-gathered 0 bytes"
                  r"|只能通过 step 之后的 all-gather 拿到|共 all-gather 了 0 字节",
                  "stepped the shard but never all-gathered it, so the other ranks keep stale parameters",
                  "只更新了自己的分片，没有 all-gather，其他 rank 的参数仍是旧的",
                  "notebooks/04_stage1.ipynb § 1", ("ex04",)),
    Misconception("accumulate-overwrites", r"only micro-step \d+'s share|只是第 \d+ 个微批次（共 \d+ 个）的那一份",
                  "overwrote the gradient shard at each micro-step instead of adding to it",
                  "每个 micro-step 覆盖了梯度分片，而不是累加（梯度累积）", "notebooks/05_stage2.ipynb § 5", ("ex05",)),
    Misconception("ledger-prediction", r"you predicted \w+ = |你预测 \w+ = ",
                  "predicted the wrong number of collectives per step with gradient accumulation",
                  "梯度累积时每步的集合通信次数预测错了", "notebooks/05_stage2.ipynb § 5", ("ex05",)),
    Misconception("never-released", r"still gathered after the optimizer step|gathered parameters are still held"
                  r"|never released|优化器 step 之后还有 unit 处于 gather 状态|step 之后仍持有 \d+ 字节 gather 来的参数"
                  r"|从不释放",
                  "never released a gathered unit, so stage 3 holds the whole model (and stale weights)",
                  "收集（gather）后的单元从不释放，ZeRO-3 因而持有整个模型（而且是旧权重）",
                  "notebooks/06_stage3.ipynb § 1", ("ex06",)),
    Misconception("fp32-to-device", r"copies of float32; expected|Cast the fp32 master to the compute dtype"
                  r"|dtype 为 float32；应为|先在 host 上把 fp32 主权重转成计算 dtype",
                  "sent the fp32 master to the device and cast there: twice the bytes over PCIe",
                  "把 fp32 主权重传到设备上再转换：PCIe 上的字节数翻倍", "notebooks/08_offload.ipynb § 3", ("ex07",)),
    Misconception("one-scale", r"scale of the whole tensor|整个张量的 scale",
                  "used one quantization scale for the whole tensor instead of one per block",
                  "整个张量只用了一个量化 scale，而不是每个块一个", "notebooks/09_zeropp.ipynb Part 1", ("ex08",)),
    Misconception("no-reserve", r"\(1 - reserve\)",
                  "compared the model states with the whole GPU memory, leaving nothing for activations",
                  "拿模型状态和整块显存比较，没有给激活留出余量", "notebooks/13_choosing.ipynb § 1", ("ex09",)),
)


def explain(exercise: str, message: str) -> list[Misconception]:
    """Every catalogue entry that explains a failed test's message (one message can name two mistakes: "only
    micro-step 2's share of it, and 2 times too big")."""
    return [m for m in CATALOGUE if (not m.exercises or exercise.startswith(m.exercises))
            and re.search(m.pattern, message)]


@dataclass
class Row:
    key: str
    en: str
    zh: str
    revisit: str
    learners: set[str]
    out_of: set[str]
    checks: list[str]


def rank(results: list[ExerciseResult]) -> list[Row]:
    """Every misconception and every unexplained failed check, with the learners behind it, most learners first."""
    graded: dict[str, set[str]] = {}
    for r in results:
        if r.status == "graded":
            graded.setdefault(r.exercise, set()).add(r.learner)
    rows: dict[str, Row] = {}
    for r in results:
        if r.status != "graded":
            continue
        for t in r.tests:
            if t.passed:
                continue
            where = f"{r.exercise}: {t.name}" + (" (hidden)" if t.hidden else "")
            found = [rows.setdefault(m.key, Row(m.key, m.en, m.zh, m.revisit, set(), set(), []))
                     for m in explain(r.exercise, t.message)]
            if not found:
                key = f"check:{r.exercise}:{t.grade_id}"
                found = [rows.setdefault(key, Row(key, f"failed the check “{t.name}” for another reason",
                                                  f"未通过检查“{t.name}”（其他原因）", r.exercise, set(), set(), []))]
            for row in found:
                row.learners.add(r.learner)
                row.out_of |= graded[r.exercise]
                if where not in row.checks:
                    row.checks.append(where)
    return sorted(rows.values(), key=lambda row: (-len(row.learners), row.key.startswith("check:"), row.key))


def _md(text: str) -> str:
    """A check name or path in a Markdown table cell: no pipe, no newline, no HTML."""
    return (text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
            .replace("\n", " "))


def report(results: list[ExerciseResult], lang: str = "en") -> str:
    rows = rank(results)
    learners = sorted({r.learner for r in results if r.status == "graded"})
    zh = lang == "zh"
    lines = [("# 全班的常见误解" if zh else "# What the class got wrong"), "",
             (f"{len(learners)} 名学员的提交已评分。每一行按学员计数（同一个错误导致多项检查失败时只计一次），"
              "分母是交了该练习的学员数。" if zh else
              f"{len(learners)} learners graded. Each row counts learners, not failed checks (one mistake that "
              "fails five checks counts once), out of the learners who handed that exercise in."), ""]
    if not rows:
        lines.append("所有检查都通过了。" if zh else "Every check passed.")
        return "\n".join(lines) + "\n"
    lines += (["| 排名 | 学员 | 误解 | 检查 | 复习 |", "|---|---|---|---|---|"] if zh else
              ["| rank | learners | misconception | checks | revisit |", "|---|---|---|---|---|"])
    for i, row in enumerate(rows, 1):
        count = (f"{len(row.out_of)} 人中 {len(row.learners)} 人" if zh else
                 f"{len(row.learners)} of {len(row.out_of)}")
        lines.append(f"| {i} | {count} | {_md(row.zh if zh else row.en)} | {_md('; '.join(row.checks))} | "
                     f"{_md(row.revisit)} |")
    lines += ["", "## 各误解涉及的学员" if zh else "## Who, per misconception", ""]
    for row in rows:
        lines.append(f"- {_md(row.zh if zh else row.en)}: {_md(', '.join(sorted(row.learners)))}")
    return "\n".join(lines) + "\n"


def write_reports(results: list[ExerciseResult], path: Path) -> list[Path]:
    """The report in English at `path` and in 中文 beside it (report.md -> report.zh.md)."""
    zh_path = path.with_name(path.stem + ".zh" + (path.suffix or ".md"))
    path.write_text(report(results, "en"), encoding="utf-8")
    zh_path.write_text(report(results, "zh"), encoding="utf-8")
    return [path, zh_path]
