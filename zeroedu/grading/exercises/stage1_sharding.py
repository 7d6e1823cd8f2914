"""Exercise 4 (ex04_stage1_sharding): the learner's Stage1 subclass trained in the real engine, and its checks.

The learner overrides reduce_bucket, optimizer_step and publish; the engine trains with that class on real gloo
ranks (zeroedu.grading.exercises.training). ShardedRun checks the collectives of the sharded stages (1 and 2: exercise 5
extends it).
"""

from __future__ import annotations

from zeroedu.engine.stages import Stage1
from zeroedu.grading.exercises.learner_code import _itemsize, _learner_or, first_stub
from zeroedu.grading.exercises.training import Case, TrainRun, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr


class ShardedRun(TrainRun):
    """Checks of the sharded stages (1 and 2): which collectives moved the gradients and the parameters."""

    def ledger_bytes(self, i: int, rank: int, step: int, op: str, kind: str) -> tuple[int, int, int]:
        """(calls, tensor bytes, bytes sent) of `op` on `kind` in the ledger of case i, rank, step (Stage2Run reads it
        too, from its own module: a public name)."""
        entries = [e for e in self.ranks[i][rank]["ledger"]
                   if e["op"] == op and e["kind"] == kind and e["step"] == step]
        return len(entries), sum(e["tensor_bytes"] for e in entries), sum(e["sent_bytes"] for e in entries)

    def _full_bytes(self, i: int) -> int:
        row = self.ranks[i][0]
        return sum(b["padded"] for b in row["layout"]) * _itemsize(row["dtype"])

    def check_bytes(self) -> None:
        """Per optimizer step and rank: gradients reduce-scattered ((N-1)/N·S per micro-step that reduces: every
        micro-step at stage 2, the last one at stage 1), parameters all-gathered ((N-1)/N·S), no all-reduce."""
        self.ran()
        for i, case in enumerate(self.cases):
            if case.engine != "yours":
                continue
            n, full = case.world_size, self._full_bytes(i)
            times = case.accum if self.ranks[i][0]["stage"] >= 2 else 1
            for rank in range(n):
                for step in range(case.steps):
                    where = tr(f"{case.name}, rank {rank}, step {step}:", f"{case.name}，rank {rank}，第 {step} 步：")
                    k, _, _ = self.ledger_bytes(i, rank, step, "all_reduce", "grads")
                    if k:
                        raise AssertionError(tr(f"{where} {k} all-reduce(s) of gradients. A sharded stage "
                                                "reduce-scatters them: each rank needs only the reduced gradient of "
                                                "its own piece.",
                                                f"{where}梯度做了 {k} 次 all-reduce。分片的 stage 要对梯度做 "
                                                "reduce-scatter：每个 rank 只需要自己那一块归约后的梯度。"))
                    k, tensor, sent = self.ledger_bytes(i, rank, step, "reduce_scatter", "grads")
                    if tensor != times * full or sent != times * (n - 1) * full // n:
                        per = tr(f"{times} micro-step(s) x ", f"{times} 个微批次 x ") if times > 1 else ""
                        raise AssertionError(tr(
                            f"{where} reduce-scattered {tensor} bytes of gradients in {k} call(s), sending {sent}; "
                            f"expected {per}the whole {full}-byte flat buffer once, sending {per}(N-1)/N·S = "
                            f"{(n - 1) * full // n} bytes. Reduce-scatter each bucket once"
                            + (" per micro-step." if times > 1 else " per step, at the accumulation boundary."),
                            f"{where}{k} 次调用共 reduce-scatter 了 {tensor} 字节梯度，发送 {sent} 字节；"
                            f"应为 {per}整个 {full} 字节的扁平缓冲区各一次，发送 {per}(N-1)/N·S = "
                            f"{(n - 1) * full // n} 字节。每个桶"
                            + ("每个微批次 reduce-scatter 一次。" if times > 1
                               else "每步在梯度累积的边界 reduce-scatter 一次。")))
                    k, tensor, sent = self.ledger_bytes(i, rank, step, "all_gather", "params")
                    if tensor != full:
                        raise AssertionError(tr(
                            f"{where} all-gathered {tensor} bytes of parameters in {k} call(s); every bucket must be "
                            f"all-gathered once after the step ({full} bytes in all), so that each rank gets the "
                            "pieces the other ranks updated." if tensor < full else
                            f"{where} all-gathered {tensor} bytes of parameters in {k} call(s), more than the "
                            f"{full}-byte flat buffer: gather each bucket once per step.",
                            f"{where}{k} 次调用共 all-gather 了 {tensor} 字节参数；每个桶在 step 之后都要 all-gather "
                            f"一次（共 {full} 字节），每个 rank 才能拿到其他 rank 更新的那几块。" if tensor < full else
                            f"{where}{k} 次调用共 all-gather 了 {tensor} 字节参数，超过了 {full} 字节的扁平缓冲区："
                            "每步每个桶只 gather 一次。"))


def run_stage1(cls: type, cases: list[Case]) -> ShardedRun:
    """Train the learner's Stage1 subclass; references: one process on the global batch, the ledger's bytes."""
    stub = in_kernel(first_stub, cls, {"reduce_bucket": (None,), "optimizer_step": ([], 1.0), "publish": ()})
    what = getattr(cls, "__name__", tr("your stage 1", "你的 stage 1"))
    if stub is not None:
        return ShardedRun(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_learner_or(Stage1, cls), cases, what=what)
    return ShardedRun(run.what, run.cases, run.ranks, run.refs, run.error)
