"""Exercise 6 (ex06_stage3_gather): the learner's Stage3 fetch and release in the real engine, and their checks.

The learner's Stage3 subclass trains on real gloo ranks (zeroedu.grading.exercises.training) under _GatherMeter, which
notes the bytes of gathered parameters at every fetch and release; Stage3Run compares them, and the parameter
all-gathers, with the engine's own stage 3 on the same cases (exercise 8's QwzRun extends it).
"""

from __future__ import annotations

from typing import Any

import torch

from zeroedu.engine.stages import Stage3
from zeroedu.grading.exercises.learner_code import _learner_or, first_stub
from zeroedu.grading.exercises.training import Case, TrainRun, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr


class _GatherMeter:
    """Notes the bytes of gathered parameters after every fetch and release, and how often each is called."""

    def _gathered_now(self) -> int:
        storages = {}
        tensors = [p.data for p in self.layout.params] + list(self.unit_buffers.values()) + list(self.gathered.values())
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.nbytes():
                    storages[st.data_ptr()] = st.nbytes()
        persistent = sum(self.layout.buckets[u].padded for u in self.persistent) * self.param_shard.element_size()
        return sum(storages.values()) - persistent

    def _meter(self, what: str) -> None:
        m = self.__dict__.setdefault("meter", {"fetch": 0, "release": 0, "peak": [], "after_step": []})
        m[what] += 1
        now = self._gathered_now()
        while len(m["peak"]) <= self.global_step:
            m["peak"].append(0)
        m["peak"][self.global_step] = max(m["peak"][self.global_step], now)

    def fetch(self, u: int) -> None:
        super().fetch(u)
        self._meter("fetch")

    def release(self, u: int) -> None:
        super().release(u)
        self._meter("release")

    def publish(self) -> None:
        super().publish()
        self.__dict__.setdefault("meter", {"fetch": 0, "release": 0, "peak": [], "after_step": []})
        self.meter["after_step"].append(self._gathered_now())


def _meter(engine: Any, case: Case) -> dict:
    model = sum(b.padded for b in engine.layout.buckets if b.index not in engine.persistent)
    return {"meter": getattr(engine, "meter", None), "model_bytes": model * engine.param_shard.element_size()}


class Stage3Run(TrainRun):
    def replica_problem(self, i: int, step: int) -> str | None:
        return None   # stage 3 keeps no full parameters between steps; the trains check says what went wrong

    def _kept(self, i: int) -> bool:
        meter = self.ranks[i][0].get("meter") if self.cases[i].engine == "yours" else None
        return bool(meter and any(meter["after_step"]))

    def check_trains(self) -> None:
        self.ran()
        for i, case in enumerate(self.cases):
            try:
                self._check_case(i, case)
            except AssertionError as e:
                if not self._kept(i):
                    raise
                raise AssertionError(tr(f"{e} Units were still gathered after the optimizer step, so the next "
                                        "forward computed with the old weights: once released, a unit is gathered "
                                        "again from the updated shards.",
                                        f"{e} 优化器 step 之后还有 unit 处于 gather 状态，所以下一次 forward 用的是"
                                        "旧权重：unit 释放之后，下次要从更新后的分片重新 gather。")) from None

    def _pair(self, i: int) -> int | None:
        """The engine's own run of the same model and config, if the run has one."""
        case = self.cases[i]
        return next((j for j, c in enumerate(self.cases) if c.engine == "zeroedu" and c.model == case.model and
                     c.world_size == case.world_size and c.zero == case.zero), None)

    def _yours_with_pair(self):
        """(i, case, j) for each run of your code that has the engine's own run j to compare with."""
        self.ran()
        for i, case in enumerate(self.cases):
            j = self._pair(i)
            if case.engine == "yours" and j is not None:
                yield i, case, j

    def check_memory(self) -> None:
        """Gathered parameters: after the first step (which records the order of modules) the peak is no higher
        than the engine's own stage 3 on the same model, and nothing stays gathered after a step."""
        self.ran()
        for i, case in enumerate(self.cases):
            if case.engine != "yours":
                continue
            row = self.ranks[i][0]
            meter = row["meter"]
            if not meter or not meter["fetch"]:
                raise AssertionError(tr(f"{case.name}: fetch was never called (the engine no longer calls it: "
                                        "zeroedu.grading.exercises.stage3_gather needs updating).",
                                        f"{case.name}：fetch 从未被调用（引擎不再调用它："
                                        "zeroedu.grading.exercises.stage3_gather 需要更新）。"))
            if not meter["release"]:
                raise AssertionError(tr(f"{case.name}: release was never called (the engine no longer calls it: "
                                        "zeroedu.grading.exercises.stage3_gather needs updating).",
                                        f"{case.name}：release 从未被调用（引擎不再调用它："
                                        "zeroedu.grading.exercises.stage3_gather 需要更新）。"))
            model = row["model_bytes"]
            left = [b for b in meter["after_step"] if b > 0]
            if left:
                raise AssertionError(tr(
                    f"{case.name}: after an optimizer step {left[0]} bytes of gathered parameters are still held "
                    f"(the whole model is {model} bytes). release(u) must free the unit's memory: point each "
                    "parameter at an empty tensor and resize the buffer's storage to 0 bytes.",
                    f"{case.name}：优化器 step 之后仍持有 {left[0]} 字节 gather 来的参数（整个模型 {model} 字节）。"
                    "release(u) 必须释放 unit 的显存：让每个参数指向空张量，并把缓冲区的 storage resize 到 0 字节。"))
            j = self._pair(i)
            if j is None:
                continue
            mine, theirs = meter["peak"][1:], self.ranks[j][0]["meter"]["peak"][1:]
            for step, (a, b) in enumerate(zip(mine, theirs, strict=False), start=1):
                if a > b:
                    raise AssertionError(tr(
                        f"{case.name}: during step {step} up to {a} bytes of parameters were gathered at once, the "
                        f"engine's own stage 3 needs at most {b} (the whole model is {model} bytes): "
                        + ("nothing is ever released. " if a >= model else "some unit is released late, or not "
                           "at all. ")
                        + "release(u) must drop the unit's full parameters right away.",
                        f"{case.name}：第 {step} 步中同时 gather 的参数最多达 {a} 字节，引擎自己的 ZeRO-3 最多只要 "
                        f"{b} 字节（整个模型 {model} 字节）："
                        + ("什么都没有释放。" if a >= model else "有的 unit 释放得太晚，或者根本没释放。")
                        + "release(u) 必须立刻丢掉 unit 的完整参数。"))

    def check_bytes(self) -> None:
        """Parameter all-gathers per step: the engine's own count and bytes (forward and backward, each unit once)."""
        for i, case, j in self._yours_with_pair():
            for step in range(case.steps):
                (a, sa), (b, sb) = _gathers(self.ranks[i][0], step), _gathers(self.ranks[j][0], step)
                if (a, sa) != (b, sb):
                    raise AssertionError(tr(
                        f"{case.name}, step {step}: {a} parameter all-gathers sending {sa} bytes; the engine's own "
                        f"stage 3 runs {b}, sending {sb}. "
                        + ("fetch(u) must do nothing when u is gathered already." if a > b else
                           "Units that are never released are never gathered again." if self._kept(i) else
                           "Every fetch of a unit that is not gathered must all-gather it."),
                        f"{case.name}，第 {step} 步：参数 all-gather {a} 次，发送 {sa} 字节；引擎自己的 ZeRO-3 "
                        f"是 {b} 次，发送 {sb} 字节。"
                        + ("u 已经 gather 过时，fetch(u) 什么都不该做。" if a > b else
                           "从不释放的 unit 也就不会再被 gather。" if self._kept(i) else
                           "每次 fetch 一个还没 gather 的 unit，都必须对它做 all-gather。")))


def _gathers(row: dict, step: int) -> tuple[int, int]:
    es = [e for e in row["ledger"] if e["op"].startswith("all_gather") and e["kind"] == "params" and e["step"] == step]
    return len(es), sum(e["sent_bytes"] for e in es)


def run_stage3(cls: type, cases: list[Case]) -> Stage3Run:
    """Train the learner's Stage3 subclass next to the engine's own stage 3 on the same cases."""
    stub = in_kernel(first_stub, cls, {"fetch": (0,), "release": (0,)})
    what = getattr(cls, "__name__", tr("your stage 3", "你的 stage 3"))
    if stub is not None:
        return Stage3Run(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_learner_or(Stage3, cls, _GatherMeter), cases, what=what, extra=_meter)
    run = Stage3Run(run.what, run.cases, run.ranks, run.refs, run.error)
    if run.error and "storage" in run.error and "out of bounds" in run.error:
        run.error += tr(" -- autograd kept views of the weights it saved in forward, and they point at the unit's "
                        "buffer: gather into the same buffer again (self.unit_buffers[u], its storage resized back "
                        "to full size), not into a new tensor.",
                        " —— autograd 保留了 forward 时保存的权重视图，它们指向 unit 的缓冲区：要 gather 回同一个"
                        "缓冲区（self.unit_buffers[u]，先把 storage resize 回完整大小），而不是一个新张量。")
    return run
