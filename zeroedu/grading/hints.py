"""Hints before the answer: each answer cell's checks come with three hints, from a nudge to nearly the solution.

A learner grading their own notebook (`zeroedu grade exercises/ex01_memory_formulas.ipynb`) sees, under each
failed check, the first hint the first time that check fails, the second the next time, the third after that.
The attempts are counted per check in exercises/.zeroedu-grades/<exercise>.hints.json, next to the grades
`zeroedu progress` reads. `zeroedu grade --hints` (or `python -m zeroedu.grading.hints`) prints every hint of
every check for instructors, in English and 中文.

TOPICS covers every test cell of every solution (tests/test_kit_hints.py checks it): a topic is one answer cell,
or a few cells that one idea joins (exercise 7's offload step), with the test grade_ids it explains.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# topic -> (test grade_ids, [(English, 中文), ...] from a nudge to nearly the answer)
TOPICS: dict[str, tuple[tuple[str, ...], list[tuple[str, str]]]] = {
    "ex01-bytes-per-element": (("ex01-test-precision",), [
        ("How many bits does each precision use? Bytes are bits / 8.", "每种精度用多少位？字节数 = 位数 / 8。"),
        ("fp32 is 32 bits; bf16 and fp16 are 16 bits each.", "fp32 是 32 位；bf16 和 fp16 都是 16 位。"),
        ("Return 4 for fp32 and 2 for bf16 or fp16; torch.finfo(dtype).bits // 8 says the same.",
         "fp32 返回 4，bf16 或 fp16 返回 2；torch.finfo(dtype).bits // 8 也给出同样的值。")]),
    "ex01-model-state-bytes": (("ex01-test-stage0", "ex01-test-table1", "ex01-test-live", "ex01-hidden-formulas",
                                "ex01-hidden-errors"), [
        ("Write the three model states separately: parameters, gradients, optimizer states. Which ones does each "
         "stage split across the N ranks?",
         "把三类模型状态分开写：参数、梯度、优化器状态。每个阶段分别把哪些分片到 N 个 rank 上？"),
        ("Stage 1 divides the optimizer states by N, stage 2 the gradients too, stage 3 the parameters too; "
         "a state a stage does not split stays whole.",
         "ZeRO-1 把优化器状态除以 N，ZeRO-2 再加上梯度，ZeRO-3 再加上参数；本阶段不分片的状态保持完整。"),
        ("Per rank: parameters b·Ψ (÷N at stage 3), gradients b·Ψ (÷N at stages 2-3), optimizer states K·Ψ "
         "(÷N at stages 1-3); raise ValueError for a stage outside 0-3 or N < 1.",
         "每个 rank：参数 b·Ψ（ZeRO-3 时 ÷N），梯度 b·Ψ（ZeRO-2/3 时 ÷N），优化器状态 K·Ψ（ZeRO-1/2/3 时 ÷N）；"
         "stage 不在 0-3 或 N < 1 时抛出 ValueError。")]),
    "ex02-reduce-scatter": (("ex02-test-rs-sum", "ex02-test-rs-average", "ex02-test-rs-bytes", "ex02-hidden-rs"), [
        ("Split the tensor into N chunks. In N-1 steps each rank sends one partial sum to its right neighbour "
         "and adds the one it receives from its left.",
         "把张量切成 N 块。N-1 步里，每个 rank 把一个部分和发给右邻居，并加上从左邻居收到的那一块。"),
        ("Neighbours wrap around: right is (rank + 1) % N, left is (rank - 1) % N. Pick the starting chunk so "
         "that after N-1 steps rank r holds the full sum of chunk r; with average=True divide it by N.",
         "邻居要取模：右边是 (rank + 1) % N，左边是 (rank - 1) % N。选好起始块，使 N-1 步之后 rank r 持有第 r 块的"
         "完整和；average=True 时再除以 N。"),
        ("Start with your copy of chunk (r - 1) % N. At step s send that partial sum right, receive the partial "
         "sum of chunk (r - s - 2) % N from the left and add your own copy of that chunk; pair each isend with an "
         "irecv and wait for both before the next step.",
         "从你自己的第 (r - 1) % N 块开始。第 s 步把这个部分和发给右邻居，从左邻居收第 (r - s - 2) % N 块的部分和，"
         "再加上你自己的那一块；每个 isend 都配一个 irecv，两者都 wait 完再进入下一步。")]),
    "ex02-all-gather": (("ex02-test-ag-values", "ex02-test-ag-bytes", "ex02-hidden-ag"), [
        ("All-gather is the reduce-scatter's ring without the addition: each rank forwards a chunk it has.",
         "all-gather 就是没有加法的 reduce-scatter ring：每个 rank 转发自己已有的一块。"),
        ("Start from your own chunk r; in each of N-1 steps send the chunk you received last and store the one "
         "that arrives.", "从自己的第 r 块开始；N-1 步里每一步发送上一步收到的块，并保存新收到的块。"),
        ("At step s send chunk (r - s) % N to (r + 1) % N and receive chunk (r - s - 1) % N from (r - 1) % N; "
         "every rank sends (N-1)/N of the tensor in all.",
         "第 s 步把第 (r - s) % N 块发给 (r + 1) % N，从 (r - 1) % N 收第 (r - s - 1) % N 块；每个 rank 总共发送"
         "张量的 (N-1)/N。")]),
    "ex02-all-reduce": (("ex02-test-ar-values", "ex02-test-ar-bytes", "ex02-hidden-ar"), [
        ("You have already written both halves of an all-reduce.", "all-reduce 的两半你已经写好了。"),
        ("All-reduce = reduce-scatter, then all-gather of the reduced chunks: 2(N-1)/N of the tensor sent.",
         "all-reduce = 先 reduce-scatter，再对归约后的块 all-gather：共发送张量的 2(N-1)/N。"),
        ("Call your ring_reduce_scatter, then your ring_all_gather on its result, and return the gathered tensor.",
         "先调用 ring_reduce_scatter，再对其结果调用 ring_all_gather，返回收集到的完整张量。")]),
    "ex03-assign-buckets": (("ex03-test-buckets", "ex03-hidden-buckets"), [
        ("Walk the parameters in order and add each to the open bucket while it fits.",
         "按顺序遍历参数，放得下就放进当前的桶。"),
        ("A bucket that would be exactly full with this parameter still takes it; close it only when the next "
         "one would go over the cap.", "放入这个参数后刚好装满的桶仍然要放；只有下一个参数会超过上限时才关闭这个桶。"),
        ("Keep a running size: if size + numel > cap and the bucket is not empty, start a new bucket; then "
         "append the index and add numel.",
         "维护当前大小：若 size + numel > cap 且桶不空，就开一个新桶；然后放入下标并加上 numel。")]),
    "ex03-bucket-hooks": (("ex03-test-trains", "ex03-test-overlap", "ex03-test-bytes", "ex03-hidden-hooks"), [
        ("Overlap means a bucket is all-reduced during backward, as soon as it is complete.",
         "通信与计算重叠的意思是：反向过程中，一个桶一凑齐就 all-reduce。"),
        ("Count, per bucket, how many of its gradients have arrived in the post-accumulate-grad hook; when the "
         "last one arrives, reduce that bucket at once.",
         "在 post-accumulate-grad hook 里按桶计数已到达的梯度；最后一个到达时立刻归约这个桶。"),
        ("Map each parameter to its bucket in __init__; before_backward sets waiting[b] = len(bucket b); in "
         "grad_ready (only when reduce_now) do waiting[b] -= 1 and call reduce(b) when it reaches 0.",
         "在 __init__ 里记下每个参数属于哪个桶；before_backward 设 waiting[b] = 桶 b 的大小；grad_ready 里（仅当 "
         "reduce_now 时）waiting[b] -= 1，减到 0 就调用 reduce(b)。")]),
    "ex04-piece-bounds": (("ex04-test-bounds", "ex04-hidden-bounds"), [
        ("Each rank owns one contiguous piece of the flat buffer; the N pieces cover it exactly once.",
         "每个 rank 拥有扁平缓冲区中连续的一段；N 段恰好覆盖整个缓冲区一次。"),
        ("Use the padded size: the buffer is padded to a multiple of N, so every piece has the same length.",
         "用补齐后的大小：缓冲区补齐到 N 的倍数，所以每段一样长。"),
        ("piece = padded // N; rank r owns [r * piece, (r + 1) * piece), clipped to the real length.",
         "piece = padded // N；rank r 拥有 [r * piece, (r + 1) * piece)，再截到真实长度以内。")]),
    "ex04-stage1": (("ex04-test-trains", "ex04-test-replicas", "ex04-test-bytes", "ex04-hidden-stage1"), [
        ("A stage-1 step: reduce-scatter the gradients, step your own piece, then share the updated piece.",
         "ZeRO-1 的一步：reduce-scatter 梯度，更新自己的分片，然后把更新后的分片分享出去。"),
        ("After the optimizer step only your piece is new; the others reach you through an all-gather.",
         "优化器更新之后只有你自己的分片是新的；其他分片要通过 all-gather 才能到你这里。"),
        ("Copy the new fp32 master piece into your slice of the parameter buffer (in its dtype), then all-gather "
         "every bucket once so each rank holds the whole updated model.",
         "把新的 fp32 主权重分片（转成参数的 dtype）写进参数缓冲区中属于你的那一段，然后每个桶 all-gather 一次，"
         "使每个 rank 都持有完整的更新后模型。")]),
    "ex05-stage2": (("ex05-test-trains", "ex05-test-bytes", "ex05-test-freed", "ex05-hidden-stage2"), [
        ("With gradient accumulation the gradient shard must hold the sum over every micro-step.",
         "梯度累积时，梯度分片要保存所有 micro-step 的总和。"),
        ("Reduce-scatter each micro-step's bucket and add the result into your shard; average over ranks "
         "(divide by N), not only over micro-steps.",
         "每个 micro-step 的桶 reduce-scatter 之后，把结果加到你的分片上；要对 rank 求平均（除以 N），而不只是"
         "对 micro-step 求平均。"),
        ("Copy each p.grad into the bucket buffer and set p.grad = None, zero the padding, reduce-scatter the "
         "buffer with average=True into a piece-sized tensor, then self.grad_out(b).add_(it) (add, not copy).",
         "把每个 p.grad 拷进桶缓冲区并设 p.grad = None，把补齐部分清零，用 average=True 把缓冲区 reduce-scatter "
         "到一个分片大小的张量，再 self.grad_out(b).add_(它)（是累加，不是拷贝）。")]),
    "ex05-predict": (("ex05-test-predict",), [
        ("Count collectives per bucket and per micro-step.", "按桶、按 micro-step 数集合通信次数。"),
        ("Stage 2 reduce-scatters every bucket on every micro-step; each reduce-scatter sends (N-1) pieces of "
         "its padded bucket.", "ZeRO-2 在每个 micro-step 对每个桶 reduce-scatter；每次 reduce-scatter 发送补齐后桶的 "
                               "(N-1) 个分片。"),
        ("Group the sizes into buckets as exercise 3 does; reduce_scatters = micro-steps × buckets; bytes_sent = "
         "micro-steps × Σ (N-1) × ceil(bucket / N) × bytes per element.",
         "像练习 3 那样分桶；reduce_scatters = micro-step 数 × 桶数；bytes_sent = micro-step 数 × Σ (N-1) × "
         "ceil(桶大小 / N) × 每元素字节数。")]),
    "ex06-stage3": (("ex06-test-trains", "ex06-test-memory", "ex06-test-bytes", "ex06-hidden-stage3"), [
        ("A unit's full parameters exist only between its fetch and its release.",
         "一个单元的完整参数只在 fetch 和 release 之间存在。"),
        ("release must give the memory back: point the parameters at an empty tensor again, so the next "
         "forward gathers fresh (updated) weights.",
         "release 必须归还内存：把参数重新指向一个空张量，这样下一次前向会重新收集（更新后的）权重。"),
        ("fetch: all-gather the unit's shard into a full buffer and view each parameter into it; release: "
         "set each parameter's data back to an empty tensor and drop the buffer.",
         "fetch：把单元的分片 all-gather 到完整缓冲区，并让每个参数成为其中的视图；release：把每个参数的 data "
         "重新设为空张量，并丢掉缓冲区。")]),
    "ex07-offload": (("ex07-test-trains", "ex07-test-step", "ex07-test-replicas", "ex07-test-bytes",
                      "ex07-hidden-offload"), [
        ("Offload keeps the fp32 master and Adam's states on the host; the device holds only bf16 parameters "
         "and gradients.", "offload 把 fp32 主权重和 Adam 状态留在主机上；设备上只有 bf16 参数和梯度。"),
        ("Count the bytes on the bus: gradients go down once, parameters come back once, both in the compute "
         "dtype.", "数一数总线上的字节：梯度下行一次，参数回传一次，都用计算精度（compute dtype）。"),
        ("Cast the updated fp32 master to the parameters' dtype on the host, then copy that (half as many "
         "bytes) into the device parameters.",
         "在主机上把更新后的 fp32 主权重转成参数的 dtype，再把这份（字节数减半的）数据拷贝到设备参数。")]),
    "ex08-quantize": (("ex08-test-scales", "ex08-test-last-block", "ex08-test-zero-blocks", "ex08-test-roundtrip",
                       "ex08-hidden-closed-form", "ex08-test-trains", "ex08-test-bytes"), [
        ("qwZ quantizes each block of the row on its own.", "qwZ 对一行里的每个块分别量化。"),
        ("Each block's scale is its own largest absolute value / 127; a block of zeros has scale 0 and codes 0; "
         "the last block may be shorter.",
         "每个块的 scale 是它自己的最大绝对值 / 127；全零块的 scale 为 0、编码为 0；最后一个块可能更短。"),
        ("For each block: s = block.abs().max() / 127; codes = round(block / s) as int8 (0 where s == 0); "
         "dequantize with codes * s.",
         "对每个块：s = block.abs().max() / 127；codes = round(block / s) 转成 int8（s == 0 时为 0）；"
         "反量化为 codes * s。")]),
    "ex09-comm": (("ex09-test-comm", "ex09-hidden-comm"), [
        ("Write each stage's volume per step in elements first, then bytes.",
         "先按元素写出每个阶段每步的通信量，再换成字节。"),
        ("Stages 0-2 send 2Ψ (reduce-scatter + all-gather), stage 3 sends 3Ψ; each collective moves "
         "(N-1)/N of its size per rank.",
         "阶段 0-2 通信 2Ψ（reduce-scatter + all-gather），ZeRO-3 通信 3Ψ；每次集合通信每个 rank 发送其大小的 "
         "(N-1)/N。"),
        ("bytes = factor(stage) × Ψ × (N-1)/N × bytes per element, with factor 2 for stages 0-2 and 3 for "
         "stage 3; with N = 1 nothing is sent.",
         "字节数 = 系数(stage) × Ψ × (N-1)/N × 每元素字节数，阶段 0-2 系数为 2，ZeRO-3 为 3；N = 1 时不通信。")]),
    "ex09-min-gpus": (("ex09-test-min-gpus", "ex09-hidden-min-gpus"), [
        ("Find the smallest N whose per-rank model states fit.", "找出每个 rank 的模型状态放得下的最小 N。"),
        ("Only stage 3 divides everything by N; at lower stages some states stay whole, so more GPUs may never "
         "be enough.", "只有 ZeRO-3 把全部状态除以 N；低阶段有些状态保持完整，所以再多 GPU 也可能不够。"),
        ("Split the per-rank bytes into U kept whole and V divided by N; with budget = (1 - reserve) × gpu_bytes "
         "the answer is ceil(V / (budget - U)), 1 when V is 0 and U fits, None when U >= budget.",
         "把每个 rank 的字节数拆成保持完整的 U 和除以 N 的 V；预算 = (1 - reserve) × gpu_bytes，答案是 "
         "ceil(V / (预算 - U))；V 为 0 且 U 放得下时为 1，U >= 预算时为 None。")]),
    "ex09-choose": (("ex09-test-choose", "ex09-hidden-choose"), [
        ("Try the stages from 0 upward and stop at the first that fits.", "从阶段 0 往上试，取第一个放得下的阶段。"),
        ("Not all of the GPU is for model states: keep the reserve for activations.",
         "显存不全是给模型状态的：要给激活值留出 reserve。"),
        ("A stage fits when its per-rank bytes <= (1 - reserve) × gpu_bytes; return that stage with its bytes and "
         "a one-sentence reason with the numbers.",
         "当每个 rank 的字节数 <= (1 - reserve) × gpu_bytes 时该阶段放得下；返回该阶段、它的字节数，以及一句带"
         "数字的理由。")]),
    "ex10-answers": (("ex10-test-answers", "ex10-hidden-answers"), [
        ("For each claim, first decide 对 or 错, then say what the right statement is.",
         "每条说法先判断对或错，再写出正确的说法。"),
        ("Check every number against the closed forms: 16Ψ bytes of model states, 2Ψ and 3Ψ elements of "
         "communication.", "每个数字都用闭式公式核对：模型状态 16Ψ 字节，通信量 2Ψ 和 3Ψ（元素）。"),
        ("Write the verdict first, then the fix with its number and unit (元素 or 字节), using the key terms of "
         "the claim.", "先写判断，再写带数字和单位（元素或字节）的更正，并用上该说法的关键术语。")]),
}

ATTEMPTS_SUFFIX = ".hints.json"


def topic_of(grade_id: str) -> str | None:
    for topic, (tests, _) in TOPICS.items():
        if grade_id in tests:
            return topic
    return None


def hint_for(grade_id: str, attempt: int) -> tuple[str, str] | None:
    """The hint for a check's `attempt`-th failure (1 = first): later attempts get later hints, the last repeats."""
    topic = topic_of(grade_id)
    if topic is None:
        return None
    hints = TOPICS[topic][1]
    return hints[min(max(attempt, 1), len(hints)) - 1]


def attempts_file(notebook: Path, exercise: str) -> Path:
    from zeroedu.course.progress import GRADES

    return notebook.parent / GRADES / f"{exercise}{ATTEMPTS_SUFFIX}"


def record_failures(notebook: Path, result) -> dict[str, int]:
    """Count one more failure for each failed check of a self-grade; returns check -> failures so far. A check
    that passes keeps its count (a learner who breaks it again continues where they were)."""
    path = attempts_file(notebook, result.exercise)
    try:
        counts = {str(k): int(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        counts = {}
    for t in result.tests:
        if not t.passed:
            counts[t.grade_id] = counts.get(t.grade_id, 0) + 1
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return counts


def progressive(result, counts: dict[str, int], lang: str = "en") -> list[str]:
    """One line per failed check: which hint this is, and the hint in the learner's language."""
    lines = []
    for t in result.tests:
        if t.passed:
            continue
        n = counts.get(t.grade_id, 1)
        hint = hint_for(t.grade_id, n)
        topic = topic_of(t.grade_id)
        if hint is None or topic is None:
            continue
        total = len(TOPICS[topic][1])
        k = min(n, total)
        text = hint[1] if lang == "zh" else hint[0]
        label = f"提示 {k}/{total}" if lang == "zh" else f"hint {k}/{total}"
        lines.append(f"  {label} ({t.grade_id}): {text}")
    return lines


def instructor_list(lang: str | None = None) -> str:
    """Every hint of every topic, for instructors (both languages unless `lang`)."""
    lines = ["# Progressive hints 渐进提示", ""]
    for topic, (tests, hints) in TOPICS.items():
        lines.append(f"## {topic}  (checks: {', '.join(tests)})")
        for i, (en, zh) in enumerate(hints, 1):
            if lang != "zh":
                lines.append(f"{i}. {en}")
            if lang != "en":
                lines.append(f"{i}. {zh}" if lang == "zh" else f"   {zh}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lang = next((a.split("=", 1)[1] for a in argv if a.startswith("--lang=")), None)
    print(instructor_list(lang))
    return 0


if __name__ == "__main__":
    sys.exit(main())
