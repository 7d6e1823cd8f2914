# ruff: noqa: E501  -- 中文 prose: ruff counts a CJK character as two columns
"""Notebook 16, the interview trainer: what to say out loud (口述), flashcards, a mock interview, and the follow-ups
an interviewer asks next. Every number is rendered from zeroedu.theory or zeroedu.planner when the cards are built.

    from zeroedu.course import trainer
    cards = trainer.cards()                       # 口述 versions of 15's answers and follow-ups, and the new ones
    print(trainer.flashcards_markdown(cards, "zh"))   # a printable sheet
    trainer.flashcard_widget(cards)               # flip through them in JupyterLab
    walk = trainer.mock_walk(seed=0)              # one question per topic, in the order interviews go
    trainer.score(walk[0], "Stage 3 是 DDP 的 1.5 倍……")   # the numbers found, what is missing

The module itself imports no torch: theory and planner only.
"""

from __future__ import annotations

import html
import random
import re
from dataclasses import dataclass, field

from zeroedu import planner, theory
from zeroedu.grading.ex10 import extract

GB = theory.GB

__all__ = ["TOPICS", "Card", "Question", "Score", "cards", "flashcard_widget", "flashcards_html",
           "flashcards_markdown", "mock_walk", "mock_widget", "questions", "score"]


def _f(x: float) -> str:
    x = float(x)
    return f"{round(x):,}" if abs(x - round(x)) < 1e-9 else (f"{x:.3g}" if abs(x) < 10 else f"{x:,.1f}")


@dataclass(frozen=True)
class Card:
    """A flashcard: the question (front), the spoken answer and the one number to quote (back), in both languages;
    `source`: where the answer comes from (a section of notebook 15, or a citation)."""

    key: str
    q_zh: str
    q_en: str
    say_zh: str
    say_en: str
    number: str
    source: str


def _numbers() -> dict[str, float]:
    """Every number the cards quote, computed once."""
    fig1 = [theory.model_state_bytes_paper(7.5e9, 64, s) / GB for s in theory.STAGES]
    spec70 = planner.PRESETS["70B"]
    p32 = planner.plan("70B", gpus=32, gpus_per_node=8, gpu_memory_gb=80).row("stage 3")
    p16 = planner.plan("70B", gpus=16, gpus_per_node=8, gpu_memory_gb=80).row("stage 3")
    return {
        "bytes": theory.model_state_bytes_paper(1, 1, 0), "K": theory.optimizer_K("bf16"),
        "fig1_0": fig1[0], "fig1_1": fig1[1], "fig1_2": fig1[2], "fig1_3": fig1[3],
        "ratio3": theory.comm_volume_paper(3) / theory.comm_volume_paper(0),
        "states7": theory.model_state_bytes_paper(7e9, 1, 0) / GB,
        "pcie7": theory.offload_transfer_bytes_per_step(7 * 10**9, 8, 2, offload_optimizer="cpu")["host_device"] / GB,
        # DeepSpeed casts the gradient shard to fp32 on the GPU before the copy: 4 bytes down, 2 up, 6Ψ/N
        "pcie7_ds": 1.5 * theory.offload_transfer_bytes_per_step(7 * 10**9, 8, 2, offload_optimizer="cpu")["host_device"] / GB,
        "zpp": theory.zeropp_volume_paper(True, True, True),
        "hpz7": theory.zeropp_comm_bytes(7 * 10**9, 64, 8, hpz=True, precision="bf16")["hpz_secondary_bytes"] / GB,
        "accum16": theory.comm_bytes_per_step(1600, 16, 2, grad_accum=16)["total"] / theory.comm_bytes_per_step(1600, 16, 0, grad_accum=16)["total"],
        # DeepSpeed 0.19.8 at its defaults all-reduces every micro-step's gradients (2Ψ each), then all-gathers once
        "accum16_ds": (2 * 16 + 1) / theory.comm_volume_paper(0),
        "bytes_fp32acc": theory.model_state_bytes_per_param("bf16", grad_accum_dtype="fp32", keep_low_precision_grads=True)["total"],
        "megatron8": 6 + 12 / 8, "zero1_8": theory.model_state_bytes_paper(1, 8, 1),
        "states70": theory.model_state_bytes_paper(spec70.psi, 1, 0) / GB,
        "min70": -(-theory.model_state_bytes_paper(spec70.psi, 1, 0) // (80 * GB)),
        "act70": planner.activation_bytes(spec70, 2048, 1) / GB,
        "act70_rc": planner.activation_bytes(spec70, 2048, 1, recompute=True) / GB,
        "p32": p32.total_recompute / GB, "p16": p16.total_recompute / GB,
        "lora7": theory.param_bytes("bf16") * planner.PRESETS["7B"].psi / 8 / GB,
        "mics8": theory.model_state_bytes_paper(7e9, 8, 3) / GB, "n64_7": theory.model_state_bytes_paper(7e9, 64, 3) / GB,
    }


def cards() -> list[Card]:
    """The 口述 cards: 15's three answers, its follow-ups, and the questions that come next."""
    n = _numbers()
    fig = f"{_f(n['fig1_0'])} → {_f(n['fig1_1'])} → {_f(n['fig1_2'])} → {_f(n['fig1_3'])} GB"
    return [
        Card("30s", "用 30 秒讲讲 ZeRO 各阶段优化了什么？", "In 30 seconds: what does each ZeRO stage optimise?",
             f"数据并行每卡存一整份模型状态，混合精度 Adam 每参数 {_f(n['bytes'])} 字节。ZeRO 把它切到 N 张卡上：Stage 1 切优化器状态，Stage 2 再切梯度，Stage 3 再切参数。论文例子 7.5B、64 卡：{fig}。按论文的做法，Stage 1、2 通信和 DDP 一样是 2Ψ 个 16-bit 元素，Stage 3 是 3Ψ，{_f(n['ratio3'])} 倍。",
             f"Data parallelism keeps a full copy of the model states on every GPU, {_f(n['bytes'])} bytes per parameter with mixed-precision Adam. ZeRO shards it: stage 1 the optimizer states, stage 2 also the gradients, stage 3 also the parameters. 7.5B on 64 GPUs: {fig}. In the paper's schedule stages 1-2 send DDP's 2Ψ 16-bit elements; stage 3 sends 3Ψ, {_f(n['ratio3'])}x.",
             f"{_f(n['bytes'])} B/param; {_f(n['ratio3'])}×", "15 §2, 30 seconds"),
        Card("2min", "2 分钟：显存从哪来，通信量多少？", "2 minutes: where does the memory go, and what is sent?",
             f"每参数 2（bf16 参数）+ 2（梯度）+ {_f(n['K'])}（fp32 主权重、动量、方差）= {_f(n['bytes'])} 字节，7B 光模型状态就 {_f(n['states7'])} GB。Stage 1 是 4 + 12/N，Stage 2 是 2 + 14/N，Stage 3 是 16/N。DDP 的 all-reduce 就是 reduce-scatter 加 all-gather，2Ψ 个元素；Stage 1、2 把这两步拆开，还是 2Ψ（DeepSpeed 默认对梯度 all-reduce，是 3Ψ）；Stage 3 前向、反向各 all-gather 一次，3Ψ。",
             f"Per parameter 2 (bf16 weight) + 2 (gradient) + {_f(n['K'])} (fp32 master, momentum, variance) = {_f(n['bytes'])} bytes: {_f(n['states7'])} GB of model states for 7B. Stage 1 keeps 4 + 12/N, stage 2 2 + 14/N, stage 3 16/N. DDP's all-reduce is a reduce-scatter plus an all-gather, 2Ψ elements; stages 1-2 split the two, still 2Ψ (DeepSpeed's default all-reduces the gradients: 3Ψ); stage 3 gathers in forward and backward, 3Ψ.",
             f"{_f(n['states7'])} GB for 7B", "15 §2, 2 minutes"),
        Card("5min", "5 分钟：完整讲一遍，包括怎么落地。", "5 minutes: the whole answer, with practice.",
             f"先讲冗余，再讲三个阶段各切什么、各发什么（2Ψ、2Ψ、2Ψ、3Ψ 个元素，论文的做法），给论文数字 {fig}；Stage 3 的 3Ψ 前提是用完就释放，DeepSpeed 的 stage3_max_reuse_distance 会让小模型只 gather 一次。落地：放得下就用最低阶段；不够用 offload（省显存，加 PCIe，每卡每步约 {_f(n['pcie7'])} GB，7B、8 卡；DeepSpeed 拷 fp32 梯度，约 {_f(n['pcie7_ds'])} GB）；跨机慢用 ZeRO++（3Ψ → {_f(n['zpp'])}Ψ）；激活值靠重计算。",
             f"Redundancy first, then what each stage shards and sends (2Ψ, 2Ψ, 2Ψ, 3Ψ elements in the paper's schedule), with the paper's {fig}; stage 3's 3Ψ assumes release after use (DeepSpeed's stage3_max_reuse_distance gathers a small model once). In practice: the lowest stage that fits; offload when nothing fits (PCIe about {_f(n['pcie7'])} GB per GPU per step for 7B on 8 GPUs, {_f(n['pcie7_ds'])} GB with DeepSpeed's fp32 gradients); ZeRO++ over a slow network (3Ψ → {_f(n['zpp'])}Ψ); recomputation for activations.",
             f"3Ψ → {_f(n['zpp'])}Ψ", "15 §2, 5 minutes"),
        Card("fp16", "fp16 为什么要 loss scaling，bf16 不用？", "Why does fp16 need loss scaling and bf16 not?",
             "fp16 只有 5 位指数，最小正规数约 6e-5，小梯度会下溢，所以要动态损失缩放；bf16 有 8 位指数，和 fp32 一样，不下溢，缺的是精度，所以保留 fp32 主权重。",
             "fp16 has 5 exponent bits (smallest normal about 6e-5), so small gradients underflow: dynamic loss scaling. bf16 has fp32's 8 exponent bits: no underflow; it lacks precision, hence the fp32 master weights.",
             "6e-5", "15 §3.1"),
        Card("fsdp", "ZeRO 和 FSDP 什么关系？", "How do ZeRO's stages map to FSDP?",
             "FULL_SHARD（FSDP2 的 reshard_after_forward=True）就是 ZeRO-3，SHARD_GRAD_OP 接近 ZeRO-2，HSDP 接近 MiCS；通信量一样：3Ψ 和 2Ψ 个元素。",
             "FULL_SHARD (FSDP2 reshard_after_forward=True) is ZeRO-3, SHARD_GRAD_OP is close to ZeRO-2, HSDP to MiCS; the bytes are the same: 3Ψ and 2Ψ elements.",
             "3Ψ", "15 §3.2"),
        Card("zeror", "ZeRO-R 是什么？", "What is ZeRO-R?",
             "ZeRO 论文的后半：P_a 把激活检查点按张量并行切分，C_B 用固定大小的缓冲区，M_D 整理显存碎片。ZeRO-DP 本身不切激活值。",
             "The paper's second half: P_a partitions activation checkpoints across tensor-parallel ranks, C_B keeps buffers constant-size, M_D defragments. ZeRO-DP does not shard activations.",
             "P_a, C_B, M_D", "15 §3.3; Rajbhandari et al. 2020 Sec. 6"),
        Card("offload", "ZeRO-Offload 怎么工作，代价在哪？", "How does offload work, and what does it cost?",
             f"16-bit 参数和前向反向留在 GPU，fp32 主权重、Adam 状态和梯度分片放到 CPU，CPU 跑 Adam。代价是 PCIe（7B、8 卡每卡每步约 {_f(n['pcie7'])} GB，论文的 4Ψ/N；DeepSpeed 先把梯度转成 fp32，约 {_f(n['pcie7_ds'])} GB）和 CPU 上整个节点的 Adam，DeepSpeed 没有实现论文的延迟更新，它在每步的关键路径上；网络通信量不变。",
             f"16-bit weights and the forward/backward stay on the GPU; the fp32 master, Adam states and gradient shard go to the CPU, which steps Adam. The cost: PCIe (about {_f(n['pcie7'])} GB per GPU per step, 7B on 8 GPUs, the paper's 4Ψ/N; DeepSpeed casts the gradients to fp32 first, about {_f(n['pcie7_ds'])} GB) and the node's CPU Adam, on the critical path of every step since DeepSpeed never shipped the paper's delayed update; network bytes unchanged.",
             f"{_f(n['pcie7'])} GB", "15 §3.4; Ren et al. 2021"),
        Card("act", "ZeRO-3 之后显存还不够，多出来的是什么？", "ZeRO-3 fits the model states; what is left?",
             "激活值：随每卡 token 数增长，ZeRO-DP 不切。全量重计算每层只留输入（2sbh），约多一次前向；张量并行加序列并行才能把激活都除以 t。",
             "Activations: they grow with tokens per GPU and ZeRO-DP does not shard them. Full recomputation keeps each layer's input (2sbh), about one extra forward; TP plus sequence parallelism divides them by t.",
             "2sbh", "15 §3.5; Korthikanti et al. 2022"),
        Card("hpz", "hpZ 的代价？DeepSpeed 流水线为什么只配 ZeRO-1？", "What does hpZ cost? Why does DeepSpeed's pipeline take only ZeRO-1?",
             f"hpZ 每卡多存一份二级分片 2Ψ/g 字节（g = zero_hpz_partition_size，通常是每节点卡数；7B、每节点 8 卡 {_f(n['hpz7'])} GB）。流水线一步跑很多 micro-batch，Stage 2、3 每个都要通信，所以 PipelineEngine 断言 stage < 2。",
             f"hpZ keeps a secondary shard, 2Ψ/g bytes per GPU (g = zero_hpz_partition_size, usually a node's GPUs; {_f(n['hpz7'])} GB for 7B in nodes of 8). A pipeline runs many micro-batches and stages 2-3 communicate at each, so PipelineEngine asserts stage < 2.",
             f"{_f(n['hpz7'])} GB", "15 §3.6; deepspeed runtime/pipe/engine.py"),
        Card("18", "混合精度 Adam 是 16 还是 18-20 字节？", "16 or 18-20 bytes per parameter?",
             f"论文是 16。开 fp32 梯度累积（data_types.grad_accum_dtype = fp32）时多一个 4 字节缓冲区：保留 16-bit 梯度是 {_f(n['bytes_fp32acc'])}，替换它是 18。DeepSpeed 0.19.8 默认用模型精度累积。",
             f"The paper's 16. With fp32 gradient accumulation (data_types.grad_accum_dtype fp32) a 4-byte buffer joins: {_f(n['bytes_fp32acc'])} keeping the 16-bit gradient, 18 replacing it. DeepSpeed 0.19.8 accumulates in the model dtype by default.",
             f"{_f(n['bytes'])} / {_f(n['bytes_fp32acc'])}", "15 §3.7; deepspeed runtime/engine.py get_data_types"),
        Card("dsdefaults", "实测 DeepSpeed 的 ZeRO-2 通信量比 DDP 多，为什么？", "Measured, DeepSpeed's ZeRO-2 sends more than DDP. Why?",
             f"DeepSpeed 0.19.8 默认 use_multi_rank_bucket_allreduce 为 true：每个梯度桶做 all-reduce 再取本 rank 的分片，每步 3Ψ 个元素，是 DDP 的 {_f(n['ratio3'])} 倍；设成 false 才是论文的 2Ψ。ZeRO-3 反过来：默认 stage3_max_reuse_distance 为 1e9 个元素，小模型每步只 gather 一次，约 2Ψ，比它自己的 ZeRO-2 还少。另外，不写 gradient_clipping 时 DeepSpeed 按 1.0 裁剪。",
             f"DeepSpeed 0.19.8 sets use_multi_rank_bucket_allreduce true by default: every gradient bucket is all-reduced and each rank keeps its piece, 3Ψ elements a step, {_f(n['ratio3'])}x DDP; set it false for the paper's 2Ψ. ZeRO-3 the other way round: the default stage3_max_reuse_distance of 1e9 elements gathers a small model once a step, about 2Ψ, less than its own ZeRO-2. And gradient_clipping left out means 1.0 in DeepSpeed.",
             f"3Ψ = {_f(n['ratio3'])}× DDP", "15 §3.9; deepspeed runtime/zero/stage_1_and_2.py average_tensor"),
        Card("noz", "什么时候不该用 ZeRO？", "When would you not use ZeRO?",
             "DDP 放得下时（按论文 Stage 0 通信和 1、2 一样，比 DeepSpeed 默认下的 1、2 还少，而且最简单）；LoRA 只训练很小的适配器；长上下文时放不下的是激活值。",
             "When DDP fits (stage 0 sends what stages 1-2 send in the paper, less than DeepSpeed's stages 1-2 at their defaults, and is simplest); LoRA, whose adapters are tiny; long context, where activations, not model states, do not fit.",
             "2Ψ", "15 §3.8"),
        Card("megatron", "Megatron-LM 的 distributed optimizer 和 ZeRO-1 有什么区别？", "Megatron-LM's distributed optimizer against ZeRO-1?",
             f"思想就是 ZeRO-1：只切 fp32 主权重和 Adam 状态，reduce-scatter 梯度、all-gather 参数。区别在梯度：Megatron 默认 fp32 主梯度整份保留，bf16 参数时每参数 6 + 12/d 字节（d = 8 时 {_f(n['megatron8'])}），论文的 ZeRO-1 是 4 + 12/N（{_f(n['zero1_8'])}）。",
             f"It is ZeRO-1: it shards the fp32 master weights and Adam states, reduce-scatters gradients and all-gathers parameters. The difference is the gradients: Megatron keeps whole fp32 main gradients, so bf16 parameters cost 6 + 12/d bytes ({_f(n['megatron8'])} at d = 8) against the paper's ZeRO-1 4 + 12/N ({_f(n['zero1_8'])}).",
             f"6 + 12/d = {_f(n['megatron8'])}", "Megatron Core docs, Distributed Optimizer (bytes-per-parameter table)"),
        Card("hf", "HF Trainer / Accelerate 的 DeepSpeed 配置要注意什么？", "HF Trainer / Accelerate DeepSpeed configs: what matters?",
             f"\"auto\" 由 Trainer 按 TrainingArguments 填（micro batch、梯度累积、学习率、bf16），避免两处不一致。ZeRO-3 + LoRA 可以：冻结的 bf16 权重也被切分，7B、8 卡每卡约 {_f(n['lora7'])} GB，适配器的优化器状态很小。ZeRO-3 保存时要开 stage3_gather_16bit_weights_on_model_save，否则 save_16bit_model 什么也不存，只剩分片的检查点，要用 zero_to_fp32.py 合并。",
             f"\"auto\" lets the Trainer fill values from TrainingArguments (micro-batch, accumulation, learning rate, bf16), so the two never disagree. ZeRO-3 + LoRA works: the frozen bf16 weights are sharded too (about {_f(n['lora7'])} GB per GPU for 7B on 8), the adapters' optimizer state is tiny. Saving under ZeRO-3 needs stage3_gather_16bit_weights_on_model_save, else save_16bit_model writes nothing and only the sharded checkpoint is left: merge it with zero_to_fp32.py.",
             f"{_f(n['lora7'])} GB", "HF transformers DeepSpeed integration docs; deepspeed runtime/zero/config.py, runtime/engine.py save_16bit_model"),
        Card("70b", "70B 全参训练要几张卡？", "How many GPUs to fully train a 70B model?",
             f"模型状态 16 × 70B ≈ {_f(n['states70'])} GB，只算模型状态至少 {_f(n['min70'])} 张 80 GB。再加激活：2k token、micro batch 1 不重计算约 {_f(n['act70'])} GB，全量重计算约 {_f(n['act70_rc'])} GB。ZeRO-3 加重计算：16 卡每卡约 {_f(n['p16'])} GB（留 10% 余量放不下），32 卡约 {_f(n['p32'])} GB，放得下。",
             f"Model states 16 × 70B ≈ {_f(n['states70'])} GB: at least {_f(n['min70'])} GPUs of 80 GB for states alone. Then activations: at 2k tokens, micro-batch 1, about {_f(n['act70'])} GB without recomputation, {_f(n['act70_rc'])} GB with full recomputation. ZeRO-3 with recomputation: about {_f(n['p16'])} GB per GPU on 16 (no fit with 10% headroom), {_f(n['p32'])} GB on 32: fits.",
             f"{_f(n['states70'])} GB; 32 GPUs", "zeroedu.planner (Llama 2 70B preset); Korthikanti et al. 2022"),
        Card("phi", "中文博客写 16Φ，论文写 16Ψ，一样吗？", "Chinese blogs write 16Φ, the paper 16Ψ: the same?",
             f"一样，都是参数量。16Φ 是混合精度 Adam 每参数 {_f(n['bytes'])} 字节；通信里说 2Φ/2Ψ 时单位是 16-bit 元素，换成字节是 4Ψ。",
             f"The same: both name the parameter count. 16Φ is mixed-precision Adam's {_f(n['bytes'])} bytes per parameter; in communication, 2Ψ counts 16-bit elements, 4Ψ bytes.",
             "16Φ = 16Ψ", "Rajbhandari et al. 2020 Sec. 5.1"),
        Card("infinity", "ZeRO-Infinity 和 MiCS 各做了什么？", "ZeRO-Infinity and MiCS: what did each add?",
             f"ZeRO-Infinity：NVMe 作容量层，带宽为中心的分片（每个参数分到所有卡，并行用满所有 PCIe），以显存为中心的分块（大算子切块，单层不必整块放下）。MiCS：只在一个小组（比如一个节点）内分片、组间复制，all-gather 不出组；7B 在 8 卡组内 ZeRO-3 每卡 {_f(n['mics8'])} GB，而不是 64 卡的 {_f(n['n64_7'])} GB。DeepSpeed 0.19.8 已删掉自己的 MiCS 实现（mics_shard_size 会被拒绝），留下的是 ZeRO++ 的 hpZ。",
             f"ZeRO-Infinity: NVMe as a capacity tier, bandwidth-centric partitioning (every parameter spread over all GPUs, using every PCIe link at once), memory-centric tiling (huge operators split in tiles). MiCS: shard inside a small group (a node), replicate across groups, so gathers stay inside it; 7B sharded in groups of 8 keeps {_f(n['mics8'])} GB per GPU instead of {_f(n['n64_7'])} GB over 64. DeepSpeed 0.19.8 has removed its MiCS implementation (mics_shard_size is rejected); ZeRO++'s hpZ remains.",
             f"{_f(n['mics8'])} GB", "Rajbhandari et al. 2021; Zhang et al. 2022 (MiCS)"),
        Card("fsdp2", "FSDP2 和 ZeRO-3 比？", "FSDP2 against ZeRO-3?",
             "同一个思想：每步 3Ψ 个元素，每卡模型状态 16Ψ/N 字节。FSDP2 按参数用 DTensor 在第 0 维分片，没有扁平缓冲区，fp32 分片参数就是主权重；reshard_after_forward=False 相当于 ZeRO-2 的做法。",
             "The same idea: 3Ψ elements per step, 16Ψ/N bytes of model states per GPU. FSDP2 shards each parameter on dim 0 as a DTensor, with no flat buffer, and its fp32 shards are the master weights; reshard_after_forward=False behaves like ZeRO-2.",
             "16Ψ/N; 3Ψ", "PyTorch fully_shard docs; 15 §3.2"),
        Card("accum", "Stage 2 开梯度累积能省通信吗？", "Does accumulation save stage 2's communication?",
             f"每个 micro-step 都 reduce-scatter：每个优化器步 (A+1)Ψ 个元素，A = 16 时是 DDP 的 {_f(n['accum16'])} 倍；按样本算会降，最多降一半。DeepSpeed 默认每个 micro-step 做 all-reduce：(2A+1)Ψ，A = 16 时 {_f(n['accum16_ds'])} 倍。Stage 0、1 才是每步只通信一次。",
             f"It reduce-scatters at every micro-step: (A+1)Ψ elements per optimizer step, {_f(n['accum16'])}x DDP at A = 16; per sample it falls, at most by half. DeepSpeed's default all-reduces at every micro-step: (2A+1)Ψ, {_f(n['accum16_ds'])}x at A = 16. Stages 0 and 1 communicate once per step.",
             f"{_f(n['accum16'])}×", "15 A.4 #22; theory.comm_bytes_per_step"),
    ]


def flashcards_markdown(deck: list[Card], lang: str = "zh") -> str:
    """A printable sheet: one section per card, question, then what to say and the number."""
    if lang not in ("zh", "en"):
        raise ValueError(f"lang must be 'zh' or 'en', got {lang!r}")
    out = []
    for i, c in enumerate(deck, 1):
        q, say = (c.q_zh, c.say_zh) if lang == "zh" else (c.q_en, c.say_en)
        label = ("口述", "要报的数字", "出处") if lang == "zh" else ("Say", "The number", "Source")
        out.append(f"**{i}. {q}**\n\n- {label[0]}：{say}\n- {label[1]}：**{c.number}**\n- {label[2]}：{c.source}\n"
                   if lang == "zh" else
                   f"**{i}. {q}**\n\n- {label[0]}: {say}\n- {label[1]}: **{c.number}**\n- {label[2]}: {c.source}\n")
    return "\n".join(out)


def flashcards_html(deck: list[Card], lang: str = "zh") -> str:
    """The same sheet as HTML to print: a two-column table (front | back)."""
    rows = []
    for c in deck:
        q, say = (c.q_zh, c.say_zh) if lang == "zh" else (c.q_en, c.say_en)
        rows.append(f"<tr><td>{html.escape(q)}</td><td>{html.escape(say)}<br><b>{html.escape(c.number)}</b></td></tr>")
    return "<table>\n<tr><th>front</th><th>back</th></tr>\n" + "\n".join(rows) + "\n</table>"


def flashcard_widget(deck: list[Card], lang: str = "zh") -> object:
    """Flip through the cards: the front, then the back on 'flip'."""
    import ipywidgets as w

    state = {"i": 0, "back": False}
    view = w.HTML()
    flip, nxt = w.Button(description="flip · 翻面"), w.Button(description="next · 下一张")

    def show() -> None:
        c = deck[state["i"]]
        q, say = (c.q_zh, c.say_zh) if lang == "zh" else (c.q_en, c.say_en)
        body = f"<b>{html.escape(q)}</b>"
        if state["back"]:
            body += f"<p>{html.escape(say)}</p><p><b>{html.escape(c.number)}</b></p>"
        view.value = f"<p>{state['i'] + 1} / {len(deck)}</p>{body}"

    def on_flip(_: object) -> None:
        state["back"] = not state["back"]
        show()

    def on_next(_: object) -> None:
        state["i"], state["back"] = (state["i"] + 1) % len(deck), False
        show()

    flip.on_click(on_flip)
    nxt.on_click(on_next)
    show()
    return w.VBox([view, w.HBox([flip, nxt])])


# -- the mock interview --------------------------------------------------------------------------------------------
TOPICS = ("stages", "communication", "offload", "zeropp", "3d", "cluster")


@dataclass(frozen=True)
class Question:
    """One question of the 追问 tree: the numbers a good answer says (any one of each tuple, 2% tolerance) and the
    terms it names (any word of each group), with a model answer in both languages."""

    topic: str
    q_zh: str
    q_en: str
    numbers: tuple[tuple[float, str], ...]
    terms: tuple[tuple[str, ...], ...]
    model_zh: str
    model_en: str


def questions() -> list[Question]:
    n = _numbers()
    r = theory.model_state_bytes_paper
    s3_70_64 = r(70e9, 64, 3) / GB
    s2_70_64 = r(70e9, 64, 2) / GB
    return [
        Question("stages", "混合精度 Adam 每个参数的模型状态多少字节？", "Bytes of model states per parameter, mixed-precision Adam?",
                 ((n["bytes"], "16 字节/参数 · 16 B/param"),), (("主权重", "master"), ("动量", "momentum", "moment")),
                 "16 字节：bf16 参数 2、梯度 2、fp32 主权重 4、动量 4、方差 4。", "16 bytes: bf16 weight 2, gradient 2, fp32 master 4, momentum 4, variance 4."),
        Question("stages", "7.5B、64 卡，Stage 3 每卡多少 GB？", "7.5B on 64 GPUs at stage 3: GB per GPU?",
                 ((n["fig1_3"], "1.9 GB"),), (("16Ψ/N", "16/N", "16Φ/N"),),
                 f"16Ψ/N：{_f(n['fig1_3'])} GB。", f"16Ψ/N: {_f(n['fig1_3'])} GB."),
        Question("communication", "Stage 3 的通信量是 DDP 的几倍？为什么？", "Stage 3's bytes per step against DDP's, and why?",
                 ((n["ratio3"], "1.5 倍 · 1.5x"),), (("all-gather", "allgather"), ("reduce-scatter", "reducescatter")),
                 "1.5 倍：前向、反向各 all-gather 一次参数，再 reduce-scatter 梯度，3Ψ 对 DDP 的 2Ψ。",
                 "1.5x: an all-gather in the forward and again in the backward, plus the gradient reduce-scatter: 3Ψ against DDP's 2Ψ."),
        Question("communication", "Stage 2 和 DDP 谁发得多？", "Stage 2 or DDP: which sends more?",
                 ((2.0, "2Ψ"), (1.0, "1 倍 · 1x")), (("reduce-scatter", "reducescatter"), ("all-gather", "allgather")),
                 "一样，都是 2Ψ 个元素：reduce-scatter 梯度加 all-gather 参数，就是 all-reduce 拆成两半。（这是论文的做法；DeepSpeed 0.19.8 默认对梯度桶 all-reduce，3Ψ。）",
                 "The same, 2Ψ elements: a gradient reduce-scatter plus a parameter all-gather is an all-reduce in two halves. (That is the paper's schedule; DeepSpeed 0.19.8's default all-reduces the buckets: 3Ψ.)"),
        Question("offload", "7B、8 卡、Stage 2 开 CPU offload，每卡每步 PCIe 传多少？", "7B, 8 GPUs, stage 2 + CPU offload: PCIe bytes per GPU per step?",
                 ((n["pcie7"], "3.5 GB"),), (("PCIe",), ("梯度", "gradient")),
                 f"论文 4Ψ/N：经 PCIe 梯度分片下去、参数分片回来，{_f(n['pcie7'])} GB；DeepSpeed 先转 fp32，约 {_f(n['pcie7'] * 1.5)} GB。网络通信量不变。",
                 f"The paper's 4Ψ/N over PCIe: gradient shard down, parameter shard back, {_f(n['pcie7'])} GB; DeepSpeed casts to fp32 first, about {_f(n['pcie7'] * 1.5)} GB. Network bytes unchanged."),
        Question("zeropp", "ZeRO++ 三项全开，跨节点通信量降到多少？", "All of ZeRO++: cross-node bytes?",
                 ((n["zpp"], "0.75Ψ"), (0.25, "1/4"), (4.0, "4 倍 · 4x")), (("qwZ",), ("hpZ",), ("qgZ",)),
                 f"3Ψ → {_f(n['zpp'])}Ψ：qwZ int8 权重、hpZ 反向 gather 留在节点内、qgZ int4 梯度。",
                 f"3Ψ → {_f(n['zpp'])}Ψ: qwZ int8 weights, hpZ keeps the backward gather inside the node, qgZ int4 gradients."),
        Question("3d", "3D 并行里 ZeRO 怎么配？", "How does ZeRO combine in 3D parallelism?",
                 ((1.0, "ZeRO-1"),), (("TP", "张量并行", "tensor"), ("PP", "流水线", "pipeline")),
                 "TP 放节点内，PP 跨节点，DeepSpeed 的 PipelineEngine 只接受 ZeRO-0 和 ZeRO-1（它断言 stage < 2；Megatron 的 distributed optimizer 也是 ZeRO-1）；torchtitan 用 PP + FSDP2。",
                 "TP inside a node, PP across nodes; DeepSpeed's PipelineEngine takes ZeRO-0 or ZeRO-1 only (it asserts stage < 2; Megatron's distributed optimizer is ZeRO-1 too); torchtitan runs PP + FSDP2."),
        Question("cluster", "你们集群 64 张 80 GB，训练 70B，选哪个 stage？每卡模型状态多少？", "Your cluster: 64 x 80 GB, a 70B model: which stage, and how many GB of model states per GPU?",
                 ((3.0, "Stage 3"), ), (("重计算", "recomput", "激活", "activation"),),
                 f"Stage 2 每卡 {_f(s2_70_64)} GB 放不下；Stage 3 每卡 {_f(s3_70_64)} GB，再加激活，开重计算。",
                 f"Stage 2 keeps {_f(s2_70_64)} GB per GPU: no fit; stage 3 {_f(s3_70_64)} GB, plus activations, with recomputation."),
    ]


@dataclass
class Score:
    question: Question
    found: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return not self.missing

    def line(self, lang: str = "zh") -> str:
        ok = "、".join(self.found) if lang == "zh" else ", ".join(self.found)
        if self.full:
            return f"✓ {ok}"
        miss = "；".join(m.replace("the number: ", "数字：") for m in self.missing) if lang == "zh" else \
            "; ".join(self.missing)
        return (f"✓ {ok or '—'}　缺：{miss}" if lang == "zh" else f"✓ {ok or '—'}  missing: {miss}")


def score(q: Question, answer: str) -> Score:
    """The numbers of `q` the answer asserts and the terms it names; what is missing, named."""
    parsed = extract(answer)
    said = list(parsed.said)
    if any(label.startswith(("Stage", "ZeRO-")) for _, label in q.numbers):   # the answer is a stage: read names
        said += [float(m) for m in re.findall(r"(?:Stage|ZeRO-?|stage)\s*(\d)", answer)]
    out = Score(q)
    hit = [label for value, label in q.numbers if any(abs(v - value) <= 0.02 * abs(value) + 1e-9 for v in said)]
    if hit:
        out.found.append(hit[0])
    else:
        out.missing.append(f"the number: {q.numbers[0][1]}")
    low = answer.lower()
    for group in q.terms:
        if any(word.lower() in low for word in group):
            out.found.append(group[0])
        else:
            out.missing.append(group[0])
    return out


def mock_walk(seed: int = 0) -> list[Question]:
    """One question per topic, in the order an interview goes (stages → communication → offload → ZeRO++ → 3D →
    your cluster), drawn with random.Random(seed): the same seed, the same interview."""
    rng = random.Random(seed)
    qs = questions()
    return [rng.choice([q for q in qs if q.topic == t]) for t in TOPICS]


def mock_widget(seed: int = 0, lang: str = "zh") -> object:
    """The mock interview in JupyterLab: a question, a box for your answer, the score, the next question."""
    import ipywidgets as w

    walk = mock_walk(seed)
    state = {"i": 0}
    ask, box, out = w.HTML(), w.Textarea(layout=w.Layout(width="100%")), w.HTML()
    go = w.Button(description="answer · 回答")

    def show() -> None:
        q = walk[state["i"]]
        ask.value = f"<b>{state['i'] + 1}/{len(walk)} · {q.topic}</b>: {html.escape(q.q_zh if lang == 'zh' else q.q_en)}"

    def on_go(_: object) -> None:
        q = walk[state["i"]]
        s = score(q, box.value)
        model = q.model_zh if lang == "zh" else q.model_en
        out.value = f"{html.escape(s.line(lang))}<br><i>{html.escape(model)}</i>"
        state["i"] = (state["i"] + 1) % len(walk)
        box.value = ""
        show()

    go.on_click(on_go)
    show()
    return w.VBox([ask, box, go, out])
