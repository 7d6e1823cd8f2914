"""Exercise 5 (ex05_stage2_accumulation): the learner's Stage2 reduce_bucket in the real engine, and its checks.

The learner's Stage2 subclass trains on real gloo ranks (zeroedu.grading.exercises.training), noting after every
backward which full-size gradients are still held; the learner's prediction of the gradient traffic is checked against
the ledger of the engine's own stage 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from zeroedu.engine.stages import Stage2
from zeroedu.grading.exercises.learner_code import _itemsize, _learner_or, first_stub
from zeroedu.grading.exercises.stage1_sharding import ShardedRun
from zeroedu.grading.exercises.training import Case, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr


class _FreedGrads:
    """Notes, after every backward, which full-size gradients (param.grad) are still held."""

    def after_backward(self) -> None:
        super().after_backward()
        self.wait()
        held = [self.names[p] for p in self.layout.params if p.grad is not None]
        self.__dict__.setdefault("held_grads", []).append(held)


def _held(engine: Any, case: Case) -> dict:
    return {"held_grads": getattr(engine, "held_grads", [])}


class Stage2Run(ShardedRun):
    def check_freed(self) -> None:
        """After each backward no full-size gradient is left: a bucket's .grad are freed once copied."""
        self.ran()
        for i, case in enumerate(self.cases):
            if case.engine != "yours":
                continue
            for k, held in enumerate(self.ranks[i][0]["held_grads"]):
                if held:
                    names = f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}"
                    raise AssertionError(tr(
                        f"{case.name}: after backward {k}, {len(held)} parameter(s) still hold a full gradient "
                        f"({names}). Stage 2 keeps no full-size "
                        "gradient: once a bucket's gradients are copied into the bucket buffer, set each "
                        "param.grad = None.",
                        f"{case.name}：第 {k} 次 backward 之后，还有 {len(held)} 个参数持有完整梯度（{names}）。"
                        "ZeRO-2 不保留完整大小的梯度：桶的梯度拷进桶缓冲区之后，把每个 param.grad 设为 None。"))

    def measured_traffic(self, i: int) -> dict[str, int]:
        """What rank 0's ledger shows per optimizer step (step 0) for the gradients: calls and bytes sent."""
        k, _, sent = self.ledger_bytes(i, 0, 0, "reduce_scatter", "grads")
        return {"reduce_scatters": k, "bytes_sent": sent}


def run_stage2(cls: type, cases: list[Case]) -> Stage2Run:
    """Train the learner's Stage2 subclass (cases with engine="zeroedu" train the engine's own Stage2)."""
    stub = in_kernel(first_stub, cls, {"reduce_bucket": (None,)})
    what = getattr(cls, "__name__", tr("your stage 2", "你的 stage 2"))
    if stub is not None and any(c.engine == "yours" for c in cases):
        return Stage2Run(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_learner_or(Stage2, cls, _FreedGrads), cases, what=what, extra=_held)
    return Stage2Run(run.what, run.cases, run.ranks, run.refs, run.error)


def check_traffic_prediction(predict: Callable, run: Stage2Run) -> None:
    """predict(numels, world_size, bucket_numel, accum, bytes_per_element) equals the live ledger of each case
    that trained the engine's own stage (so that a mistake in your reduce_bucket does not show up here too)."""
    run.ran()
    for i, case in enumerate(run.cases):
        if case.engine == "yours":
            continue
        row = run.ranks[i][0]
        numels = [math.prod(shape) for b in row["layout"] for _, _, shape in b["params"]]
        bucket = case.zero.get("reduce_bucket_size", 50_000_000)
        elem = _itemsize(row["dtype"])
        got = predict(numels, case.world_size, bucket, case.accum, elem)
        want = run.measured_traffic(i)
        if not isinstance(got, dict) or set(got) != set(want):
            raise AssertionError(tr(f"predict_grad_traffic returned {got!r}; return a dict with the keys "
                                    f"{sorted(want)}.",
                                    f"predict_grad_traffic 返回了 {got!r}；要返回一个键为 {sorted(want)} 的 dict。"))
        for key, value in want.items():
            if got[key] != value:
                raise AssertionError(tr(
                    f"{case.name}: you predicted {key} = {got[key]}, the ledger of a live run shows {value} "
                    f"({len(numels)} parameters of {sum(numels)} elements, N = {case.world_size}, reduce_bucket_size "
                    f"= {bucket}, {case.accum} micro-step(s), {elem} bytes per element). "
                    + ("Count the buckets (greedy, in model order, a new one when the next parameter would not fit) "
                       "and the micro-steps: stage 2 reduce-scatters every bucket at every micro-step."
                       if key == "reduce_scatters" else
                       "Each bucket is padded to a multiple of N and reduce-scattered once per micro-step; a rank "
                       "sends (N-1)/N of it."),
                    f"{case.name}：你预测 {key} = {got[key]}，真实运行的通信账本（ledger）是 {value}"
                    f"（{len(numels)} 个参数共 {sum(numels)} 个元素，N = {case.world_size}，reduce_bucket_size "
                    f"= {bucket}，{case.accum} 个微批次，每个元素 {elem} 字节）。"
                    + ("数一数桶的个数（按模型顺序贪心分桶，下一个参数放不下时开新桶）和微批次数："
                       "ZeRO-2 在每个微批次都对每个桶做 reduce-scatter。"
                       if key == "reduce_scatters" else
                       "每个桶先补齐到 N 的倍数，每个微批次 reduce-scatter 一次；每个 rank 发送其中的 (N-1)/N。")))
