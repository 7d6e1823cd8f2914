"""Exercise 3 (ex03_ddp_buckets): stage 0's bucket hooks, in the real engine, and their checks.

The learner writes a hook object (before_backward, grad_ready, after_backward) that decides when each bucket is
all-reduced; HookedStage0 is stage 0 with the learner's hooks deciding, trained on real gloo ranks
(zeroedu.grading.exercises.training). The checks read the order of gradients and reductions each rank recorded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zeroedu.engine.stages import Stage0
from zeroedu.grading.exercises.learner_code import _itemsize, first_stub
from zeroedu.grading.exercises.training import Case, TrainRun, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr


class HookedStage0(Stage0):
    """Stage 0 whose buckets are all-reduced when the learner's hook object says so.

    The stage registers its own post-accumulate-grad hook on every parameter (Stage0.on_grad_ready); here that hook
    only notes the gradient's arrival, so the learner's hooks, registered after it, decide when each bucket is
    reduced. `reduce(i)` is the stage's own all-reduce of bucket i.
    """

    hooks_cls: type

    def setup(self) -> None:
        super().setup()
        self.events: list[tuple] = []
        self.index = {p: i for i, p in enumerate(self.layout.params)}
        buckets = [[self.index[p] for p in b.params] for b in self.layout.buckets]
        self.hooks = self.hooks_cls(list(self.layout.params), buckets, self._reduce)

    def on_grad_ready(self, p: torch.nn.Parameter) -> None:
        """Only noted: the learner's hooks decide when a bucket is reduced."""
        self.events.append(("grad", self.index[p]))

    def before_backward(self) -> None:
        super().before_backward()
        reduce_now = self.reduces_this_micro_step()
        self.events.append(("backward", reduce_now))
        self.hooks.before_backward(reduce_now)

    def after_backward(self) -> None:
        self.events.append(("after",))
        self.hooks.after_backward()

    def _reduce(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < len(self.layout.buckets):
            last = len(self.layout.buckets) - 1
            raise ValueError(tr(f"reduce({i!r}): the bucket index must be an int from 0 to {last}",
                                f"reduce({i!r})：桶（bucket）的下标必须是 0 到 {last} 之间的 int"))
        self.events.append(("reduce", i))
        self.reduce_bucket(self.layout.buckets[i])


def _hooks_engine(hooks_cls: type) -> Callable[[Case], type]:
    return functools.partial(_hooked, hooks_cls)


def _hooked(hooks_cls: type, case: Case) -> type:
    return type("Stage0WithYourHooks", (HookedStage0,), {"hooks_cls": hooks_cls})


def _hook_events(engine: Any, case: Case) -> dict:
    buckets = [[engine.index[p] for p in b.params] for b in engine.layout.buckets]
    return {"events": engine.events, "buckets": buckets}


class BucketHooksRun(TrainRun):
    def events_text(self, i: int = 0, backward: int = -1) -> str:
        """One backward on rank 0, as the engine saw it: gradients arriving, buckets reduced, backward's end."""
        self.ran()
        row = self.ranks[i][0]
        starts = [k for k, e in enumerate(row["events"]) if e[0] == "backward"]
        k = starts[backward]
        end = starts[starts.index(k) + 1] if k != starts[-1] else len(row["events"])
        of = {j: b for b, members in enumerate(row["buckets"]) for j in members}
        names = [name for b in row["layout"] for name, _, _ in b["params"]]
        lines = [f"{self.cases[i].name}: buckets {row['buckets']} (parameter indices), backward "
                 f"{starts.index(k)} on rank 0"]
        for e in row["events"][k + 1: end]:
            if e[0] == "grad":
                lines.append(f"  gradient ready: parameter {e[1]} ({names[e[1]]}, bucket {of[e[1]]})")
            elif e[0] == "reduce":
                lines.append(f"  all-reduce bucket {e[1]}")
            else:
                lines.append("  backward done (after_backward)")
        return "\n".join(lines)

    def check_overlap(self) -> None:
        """In a backward that reduces: each bucket once, right after its last gradient arrives (before the next
        gradient does), and a bucket with a gradient that never came, after backward. Otherwise: nothing."""
        self.ran()
        for i, case in enumerate(self.cases):
            row = self.ranks[i][0]
            problem = _overlap_problem(row["events"], row["buckets"], case.accum)
            if problem:
                raise AssertionError(f"{case.name}: {problem}")

    def check_bytes(self) -> None:
        """One all-reduce per bucket per optimizer step: 2(N-1)/N·S bytes per rank, S the padded flat buffer."""
        self.ran()
        for i, case in enumerate(self.cases):
            row = self.ranks[i][0]
            n = case.world_size
            elem = _itemsize(row["dtype"])
            full = sum(b["padded"] for b in row["layout"]) * elem
            for step in range(case.steps):
                entries = [e for e in row["ledger"] if e["kind"] == "grads" and e["step"] == step]
                ops = {e["op"] for e in entries}
                if ops - {"all_reduce"}:
                    raise AssertionError(tr(f"{case.name}: stage 0 reduces gradients with all-reduce only, found "
                                            f"{sorted(ops)}.",
                                            f"{case.name}：stage 0 只用 all-reduce 归约梯度，这里却出现了 "
                                            f"{sorted(ops)}。"))
                sent = sum(e["sent_bytes"] for e in entries)
                reduced = sum(e["tensor_bytes"] for e in entries)
                want = 2 * (n - 1) * full // n
                if reduced != full or sent != want:
                    k = len(entries)
                    raise AssertionError(tr(
                        f"{case.name}, step {step}: {k} all-reduce(s) of {reduced} bytes in all, sending {sent} bytes; "
                        f"one all-reduce per bucket of the {full}-byte flat buffer sends 2(N-1)/N·S = {want}. "
                        + ("Some bucket was reduced more than once (at every micro-step, or twice in one backward)."
                           if reduced > full else "Some bucket was never reduced."),
                        f"{case.name}，第 {step} 步：{k} 次 all-reduce，共 {reduced} 字节，发送了 {sent} 字节；"
                        f"{full} 字节的扁平缓冲区每个桶 all-reduce 一次，应发送 2(N-1)/N·S = {want} 字节。"
                        + ("有的桶被归约了不止一次（每个微批次都归约了，或者一次 backward 里归约了两次）。"
                           if reduced > full else "有的桶从未被归约。")))


def _overlap_problem(events: list[tuple], buckets: list[list[int]], accum: int) -> str | None:
    """What is wrong with the order of gradients and reductions in these events, or None."""
    of = {j: b for b, members in enumerate(buckets) for j in members}
    micro = -1
    k = 0
    while k < len(events):
        kind = events[k][0]
        if kind != "backward":
            k += 1
            continue
        micro += 1
        reduce_now = events[k][1]
        end = next((j for j in range(k + 1, len(events)) if events[j][0] == "backward"), len(events))
        span = events[k + 1: end]
        after = next((j for j, e in enumerate(span) if e[0] == "after"), len(span))
        reduced = [e[1] for e in span if e[0] == "reduce"]
        where = tr(f"in backward {micro} (micro-step {micro % accum + 1} of {accum})",
                   f"在第 {micro} 次 backward 中（{accum} 个微批次中的第 {micro % accum + 1} 个）")
        if not reduce_now:
            if reduced:
                return tr(f"bucket {reduced[0]} was all-reduced {where}, which is not the last micro-step: only the "
                          "last micro-step of an accumulation reduces (before_backward(reduce_now=False)); the "
                          "others just add their gradients into .grad.",
                          f"桶 {reduced[0]} {where}做了 all-reduce，但这不是最后一个微批次：梯度累积时只有最后一个"
                          "微批次做归约（before_backward(reduce_now=False)），其余微批次只把梯度累加到 .grad。")
            k = end
            continue
        for b in range(len(buckets)):
            times = reduced.count(b)
            if times != 1:
                return tr(f"bucket {b} was all-reduced {times} times {where}: reduce every bucket exactly once per "
                          "backward that reduces" + (" (a parameter that gets no gradient never calls its hook: "
                                                     "after_backward must reduce its bucket)." if times == 0 else "."),
                          f"桶 {b} {where}做了 {times} 次 all-reduce：需要归约的每次 backward 里，每个桶恰好归约一次"
                          + ("（拿不到梯度的参数永远不会触发它的 hook：它所在的桶要由 after_backward 来归约）。"
                             if times == 0 else "。"))
        waiting = {b: len(m) for b, m in enumerate(buckets)}
        arrived: set[int] = set()
        due: list[int] = []          # complete buckets not reduced yet
        for j, e in enumerate(span):
            if e[0] == "grad":
                if due:
                    b = due[0]
                    late = next((x for x, f in enumerate(span) if f == ("reduce", b)), len(span))
                    zh_when = "直到 backward 结束后才" if late > after else "之后才"
                    return tr(f"bucket {b} had all {len(buckets[b])} of its gradients {where}, but was all-reduced "
                              f"{'only after backward had ended' if late > after else 'only later'}, "
                              f"not before the next gradient (parameter {e[1]}) arrived: reduce a bucket as "
                              "soon as its last gradient arrives, so that its communication overlaps the rest of "
                              "backward.",
                              f"桶 {b} 的 {len(buckets[b])} 个梯度{where}已全部到齐，却{zh_when}做 all-reduce，"
                              f"没有赶在下一个梯度（参数 {e[1]}）到达之前：桶的最后一个梯度一到就要归约，"
                              "这样它的通信才能和 backward 的剩余部分重叠。")
                arrived.add(e[1])
                waiting[of[e[1]]] -= 1
                if waiting[of[e[1]]] == 0:
                    due.append(of[e[1]])
            elif e[0] == "reduce":
                b = e[1]
                if b in due:
                    due.remove(b)
                elif waiting[b] > 0 and j < after:
                    missing = [p for p in buckets[b] if p not in arrived]
                    return tr(f"bucket {b} was all-reduced {where} before its gradients for parameter(s) {missing} "
                              "had arrived: wait until every parameter of the bucket has called its hook.",
                              f"桶 {b} {where}在参数 {missing} 的梯度到达之前就做了 all-reduce："
                              "要等桶里每个参数都触发了自己的 hook 再归约。")
        if due:
            return tr(f"bucket {due[0]} was complete {where} but never reduced.",
                      f"桶 {due[0]} {where}已经齐了，却从未被归约。")
        k = end
    return None


def run_bucket_hooks(hooks_cls: type, cases: list[Case]) -> BucketHooksRun:
    """Train stage 0 with the learner's bucket hooks; the reference is one process on the global batch."""
    what = getattr(hooks_cls, "__name__", tr("your hooks", "你的 hooks"))
    stub = in_kernel(first_stub, hooks_cls, {"__init__": ([], [], print), "before_backward": (True,),
                                  "grad_ready": (torch.nn.Parameter(torch.zeros(1)),), "after_backward": ()})
    if stub is not None:
        return BucketHooksRun(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_hooks_engine(hooks_cls), cases, what=what, extra=_hook_events)
    return BucketHooksRun(run.what, run.cases, run.ranks, run.refs, run.error)
