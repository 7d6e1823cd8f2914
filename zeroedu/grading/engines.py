"""Where each engine exercise's answer goes into the real engine, and the checks that only that exercise needs.

The learner writes either a subclass of a stage that overrides the method the stage file defines (exercises 4,
5 and 6: `reduce_bucket`, `optimizer_step`, `publish`, `fetch`, `release`), or a function or small class with a
documented signature (exercises 3, 7 and 8), which an adapter here calls at the place where the engine calls its
own. Either way the real engine trains with it, on real gloo ranks (zeroedu.grading.training).

Each adapter also counts the calls of the learner's code, and the checks insist on them: if the engine stopped
calling the place an adapter plugs into, the solution notebooks would fail their tests instead of passing with
the engine's own code.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from zeroedu.fmt import approx
from zeroedu.grading.ranks import not_implemented
from zeroedu.grading.remote import in_kernel
from zeroedu.grading.training import TOLERANCE, Case, TrainRun, assemble_full, dict_rel, train_on_ranks
from zeroedu.stages import Stage0, Stage1, Stage2, Stage3

__all__ = ["Case", "first_stub", "not_your_own", "run_bucket_hooks", "run_offload", "run_qwz", "run_stage1",
           "run_stage2", "run_stage3"]


def not_your_own(cls: Any, names: Any) -> str | None:
    """Why `cls` is not a class of the learner's that writes `names` itself, or None: zeroedu's own class under
    another name (`MyStage1 = Stage1`), or a class whose method comes from zeroedu (inherited, or assigned from
    the engine's class)."""
    from zeroedu.grading.kernel import _is_learner_class, is_library_code

    if not isinstance(cls, type):
        return f"{cls!r} is not a class: write the class the template asks for"
    if not _is_learner_class(cls):
        return (f"{cls.__name__} is zeroedu's own class, not one you wrote (or passes itself off as one): define "
                f"`class {cls.__name__}(...)` in the answer cell and write its methods in its body")
    for name in names:
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if name.startswith("__") or owner is None:   # no such method: first_stub says so
            continue
        fn = vars(owner)[name]
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if not _is_learner_class(owner) or code is None or is_library_code(code):
            return (f"{cls.__name__}.{name} is zeroedu's own code (inherited from {owner.__name__}, or assigned from "
                    f"it), not yours: write {name} in your class's body")
    return None


def first_stub(cls: type, methods: dict[str, tuple]) -> str | None:
    """The NotImplementedError message of the first method of cls that is still a stub, called on a bare
    instance with the given arguments (real code fails otherwise, or needs ranks: it is not a stub); or why
    cls is not the learner's own class with those methods (not_your_own)."""
    problem = not_your_own(cls, methods)
    if problem is not None:
        return problem
    bare = object.__new__(cls)
    for name, args in methods.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__} has no method {name}: keep the method names of the template"
        message = not_implemented(fn, bare, *args)
        if message is not None:
            return message
    return None


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


# == Exercise 3: stage 0's bucket hooks ===========================================================================

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
            raise ValueError(f"reduce({i!r}): the bucket index must be an int from 0 to {len(self.layout.buckets) - 1}")
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
                    raise AssertionError(f"{case.name}: stage 0 reduces gradients with all-reduce only, found "
                                         f"{sorted(ops)}.")
                sent = sum(e["sent_bytes"] for e in entries)
                reduced = sum(e["tensor_bytes"] for e in entries)
                want = 2 * (n - 1) * full // n
                if reduced != full or sent != want:
                    k = len(entries)
                    raise AssertionError(
                        f"{case.name}, step {step}: {k} all-reduce(s) of {reduced} bytes in all, sending {sent} bytes; "
                        f"one all-reduce per bucket of the {full}-byte flat buffer sends 2(N-1)/N·S = {want}. "
                        + ("Some bucket was reduced more than once (at every micro-step, or twice in one backward)."
                           if reduced > full else "Some bucket was never reduced."))


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
        where = f"in backward {micro} (micro-step {micro % accum + 1} of {accum})"
        if not reduce_now:
            if reduced:
                return (f"bucket {reduced[0]} was all-reduced {where}, which is not the last micro-step: only the "
                        "last micro-step of an accumulation reduces (before_backward(reduce_now=False)); the "
                        "others just add their gradients into .grad.")
            k = end
            continue
        for b in range(len(buckets)):
            times = reduced.count(b)
            if times != 1:
                return (f"bucket {b} was all-reduced {times} times {where}: reduce every bucket exactly once per "
                        "backward that reduces" + (" (a parameter that gets no gradient never calls its hook: "
                                                   "after_backward must reduce its bucket)." if times == 0 else "."))
        waiting = {b: len(m) for b, m in enumerate(buckets)}
        arrived: set[int] = set()
        due: list[int] = []          # complete buckets not reduced yet
        for j, e in enumerate(span):
            if e[0] == "grad":
                if due:
                    b = due[0]
                    late = next((x for x, f in enumerate(span) if f == ("reduce", b)), len(span))
                    when = "only after backward had ended" if late > after else "only later"
                    return (f"bucket {b} had all {len(buckets[b])} of its gradients {where}, but was all-reduced "
                            f"{when}, not before the next gradient (parameter {e[1]}) arrived: reduce a bucket as "
                            "soon as its last gradient arrives, so that its communication overlaps the rest of "
                            "backward.")
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
                    return (f"bucket {b} was all-reduced {where} before its gradients for parameter(s) {missing} "
                            "had arrived: wait until every parameter of the bucket has called its hook.")
        if due:
            return f"bucket {due[0]} was complete {where} but never reduced."
        k = end
    return None


def run_bucket_hooks(hooks_cls: type, cases: list[Case]) -> BucketHooksRun:
    """Train stage 0 with the learner's bucket hooks; the reference is one process on the global batch."""
    what = getattr(hooks_cls, "__name__", "your hooks")
    stub = in_kernel(first_stub, hooks_cls, {"__init__": ([], [], print), "before_backward": (True,),
                                  "grad_ready": (torch.nn.Parameter(torch.zeros(1)),), "after_backward": ()})
    if stub is not None:
        return BucketHooksRun(what, cases, error=f"not implemented yet: {stub}")
    run = train_on_ranks(_hooks_engine(hooks_cls), cases, what=what, extra=_hook_events)
    return BucketHooksRun(run.what, run.cases, run.ranks, run.refs, run.error)


# == Exercise 4: stage 1's sharded step ==========================================================================

def _learner_or(stage_cls: type, learner_cls: type, wrap: type | None = None) -> Callable[[Case], type]:
    """The learner's class (under `wrap`, if given) for cases of the learner, the engine's own otherwise."""
    return functools.partial(_pick_class, stage_cls, learner_cls, wrap)


# The methods each stage exercise asks for: in a rank, the learner's class must define them itself.
_ASKED = {Stage1: ("reduce_bucket", "optimizer_step", "publish"), Stage2: ("reduce_bucket",),
          Stage3: ("fetch", "release")}


def _pick_class(stage_cls: type, learner_cls: type, wrap: type | None, case: Case) -> type:
    cls = learner_cls if case.engine == "yours" else stage_cls
    if case.engine == "yours":
        problem = not_your_own(learner_cls, _ASKED.get(stage_cls, ()))
        if problem is not None:
            raise AssertionError(problem)
    return type(cls.__name__, (wrap, cls), {}) if wrap is not None else cls


class ShardedRun(TrainRun):
    """Checks of the sharded stages (1 and 2): which collectives moved the gradients and the parameters."""

    def _bytes(self, i: int, rank: int, step: int, op: str, kind: str) -> tuple[int, int, int]:
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
                    where = f"{case.name}, rank {rank}, step {step}:"
                    k, _, _ = self._bytes(i, rank, step, "all_reduce", "grads")
                    if k:
                        raise AssertionError(f"{where} {k} all-reduce(s) of gradients. A sharded stage reduce-scatters "
                                             "them: each rank needs only the reduced gradient of its own piece.")
                    k, tensor, sent = self._bytes(i, rank, step, "reduce_scatter", "grads")
                    if tensor != times * full or sent != times * (n - 1) * full // n:
                        per = f"{times} micro-step(s) x " if times > 1 else ""
                        raise AssertionError(
                            f"{where} reduce-scattered {tensor} bytes of gradients in {k} call(s), sending {sent}; "
                            f"expected {per}the whole {full}-byte flat buffer once, sending {per}(N-1)/N·S = "
                            f"{(n - 1) * full // n} bytes. Reduce-scatter each bucket once"
                            + (" per micro-step." if times > 1 else " per step, at the accumulation boundary."))
                    k, tensor, sent = self._bytes(i, rank, step, "all_gather", "params")
                    if tensor != full:
                        raise AssertionError(
                            f"{where} all-gathered {tensor} bytes of parameters in {k} call(s); every bucket must be "
                            f"all-gathered once after the step ({full} bytes in all), so that each rank gets the "
                            "pieces the other ranks updated." if tensor < full else
                            f"{where} all-gathered {tensor} bytes of parameters in {k} call(s), more than the "
                            f"{full}-byte flat buffer: gather each bucket once per step.")


def run_stage1(cls: type, cases: list[Case]) -> ShardedRun:
    """Train the learner's Stage1 subclass; references: one process on the global batch, the ledger's bytes."""
    stub = in_kernel(first_stub, cls, {"reduce_bucket": (None,), "optimizer_step": ([], 1.0), "publish": ()})
    what = getattr(cls, "__name__", "your stage 1")
    if stub is not None:
        return ShardedRun(what, cases, error=f"not implemented yet: {stub}")
    run = train_on_ranks(_learner_or(Stage1, cls), cases, what=what)
    return ShardedRun(run.what, run.cases, run.ranks, run.refs, run.error)


# == Exercise 5: stage 2's gradient reduce-scatter ================================================================

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
                    raise AssertionError(
                        f"{case.name}: after backward {k}, {len(held)} parameter(s) still hold a full gradient "
                        f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}). Stage 2 keeps no full-size "
                        "gradient: once a bucket's gradients are copied into the bucket buffer, set each "
                        "param.grad = None.")

    def measured_traffic(self, i: int) -> dict[str, int]:
        """What rank 0's ledger shows per optimizer step (step 0) for the gradients: calls and bytes sent."""
        k, _, sent = self._bytes(i, 0, 0, "reduce_scatter", "grads")
        return {"reduce_scatters": k, "bytes_sent": sent}


def run_stage2(cls: type, cases: list[Case]) -> Stage2Run:
    """Train the learner's Stage2 subclass (cases with engine="zeroedu" train the engine's own Stage2)."""
    stub = in_kernel(first_stub, cls, {"reduce_bucket": (None,)})
    what = getattr(cls, "__name__", "your stage 2")
    if stub is not None and any(c.engine == "yours" for c in cases):
        return Stage2Run(what, cases, error=f"not implemented yet: {stub}")
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
            raise AssertionError(f"predict_grad_traffic returned {got!r}; return a dict with the keys "
                                 f"{sorted(want)}.")
        for key, value in want.items():
            if got[key] != value:
                raise AssertionError(
                    f"{case.name}: you predicted {key} = {got[key]}, the ledger of a live run shows {value} "
                    f"({len(numels)} parameters of {sum(numels)} elements, N = {case.world_size}, reduce_bucket_size "
                    f"= {bucket}, {case.accum} micro-step(s), {elem} bytes per element). "
                    + ("Count the buckets (greedy, in model order, a new one when the next parameter would not fit) "
                       "and the micro-steps: stage 2 reduce-scatters every bucket at every micro-step."
                       if key == "reduce_scatters" else
                       "Each bucket is padded to a multiple of N and reduce-scattered once per micro-step; a rank "
                       "sends (N-1)/N of it."))


# == Exercise 6: stage 3's gather and release ====================================================================

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
                raise AssertionError(f"{e} Units were still gathered after the optimizer step, so the next forward "
                                     "computed with the old weights: once released, a unit is gathered again from "
                                     "the updated shards.") from None

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
                raise AssertionError(f"{case.name}: fetch was never called (the engine no longer calls it: "
                                     "zeroedu.grading.engines needs updating).")
            if not meter["release"]:
                raise AssertionError(f"{case.name}: release was never called (the engine no longer calls it: "
                                     "zeroedu.grading.engines needs updating).")
            model = row["model_bytes"]
            left = [b for b in meter["after_step"] if b > 0]
            if left:
                raise AssertionError(
                    f"{case.name}: after an optimizer step {left[0]} bytes of gathered parameters are still held "
                    f"(the whole model is {model} bytes). release(u) must free the unit's memory: point each "
                    "parameter at an empty tensor and resize the buffer's storage to 0 bytes.")
            j = self._pair(i)
            if j is None:
                continue
            mine, theirs = meter["peak"][1:], self.ranks[j][0]["meter"]["peak"][1:]
            for step, (a, b) in enumerate(zip(mine, theirs, strict=False), start=1):
                if a > b:
                    raise AssertionError(
                        f"{case.name}: during step {step} up to {a} bytes of parameters were gathered at once, the "
                        f"engine's own stage 3 needs at most {b} (the whole model is {model} bytes): "
                        + ("nothing is ever released. " if a >= model else "some unit is released late, or not "
                           "at all. ")
                        + "release(u) must drop the unit's full parameters right away.")

    def check_bytes(self) -> None:
        """Parameter all-gathers per step: the engine's own count and bytes (forward and backward, each unit once)."""
        for i, case, j in self._yours_with_pair():
            for step in range(case.steps):
                (a, sa), (b, sb) = _gathers(self.ranks[i][0], step), _gathers(self.ranks[j][0], step)
                if (a, sa) != (b, sb):
                    raise AssertionError(
                        f"{case.name}, step {step}: {a} parameter all-gathers sending {sa} bytes; the engine's own "
                        f"stage 3 runs {b}, sending {sb}. "
                        + ("fetch(u) must do nothing when u is gathered already." if a > b else
                           "Units that are never released are never gathered again." if self._kept(i) else
                           "Every fetch of a unit that is not gathered must all-gather it."))


def _gathers(row: dict, step: int) -> tuple[int, int]:
    es = [e for e in row["ledger"] if e["op"].startswith("all_gather") and e["kind"] == "params" and e["step"] == step]
    return len(es), sum(e["sent_bytes"] for e in es)


def run_stage3(cls: type, cases: list[Case]) -> Stage3Run:
    """Train the learner's Stage3 subclass next to the engine's own stage 3 on the same cases."""
    stub = in_kernel(first_stub, cls, {"fetch": (0,), "release": (0,)})
    what = getattr(cls, "__name__", "your stage 3")
    if stub is not None:
        return Stage3Run(what, cases, error=f"not implemented yet: {stub}")
    run = train_on_ranks(_learner_or(Stage3, cls, _GatherMeter), cases, what=what, extra=_meter)
    run = Stage3Run(run.what, run.cases, run.ranks, run.refs, run.error)
    if run.error and "storage" in run.error and "out of bounds" in run.error:
        run.error += (" -- autograd kept views of the weights it saved in forward, and they point at the unit's "
                      "buffer: gather into the same buffer again (self.unit_buffers[u], its storage resized back "
                      "to full size), not into a new tensor.")
    return run


# == Exercise 8: qwZ's block quantization =========================================================================

QUANT_CALLS = {"quantize": 0, "dequantize": 0}
QWZ_BLOCK = 64
"""The qwZ block size of the exercise's training runs (zeroedu's default is larger than a small model's units):
every unit's piece then spans several blocks and most end in a shorter one."""


class _LearnerQuantizer:
    """zeroedu.zeropp's quantizer with the learner's functions for qwZ's int8 weights (qgZ's int4 gradients keep the
    engine's), counting the calls."""

    def __init__(self, quantize: Callable, dequantize: Callable) -> None:
        from zeroedu import zeropp

        self.quantize_blocks, self.dequantize_blocks, self.engine = quantize, dequantize, zeropp.BlockQuantizer()

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if bits != 8:
            return self.engine.quantize(x, bits, block)
        QUANT_CALLS["quantize"] += 1
        codes, scales = self.quantize_blocks(x, block)
        if codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.shape != x.shape:
            raise TypeError(f"quantize_blocks returned codes {codes.dtype}{list(codes.shape)} and scales "
                            f"{scales.dtype}{list(scales.shape)} for an input of shape {list(x.shape)}; return int8 "
                            "codes shaped like the input and float32 scales")
        return codes, scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        QUANT_CALLS["dequantize"] += 1
        return self.dequantize_blocks(codes, scales, block)


def _qwz_engine(quantize: Callable, dequantize: Callable) -> Callable[[Case], type]:
    return functools.partial(_qwz_class, quantize, dequantize)


def _qwz_class(quantize: Callable, dequantize: Callable, case: Case) -> type:
    from zeroedu import zeropp
    from zeroedu.compose import engine_class
    from zeroedu.config import load_config

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
                raise AssertionError(f"{case.name}: your functions were never called (the engine no longer calls "
                                     "its quantizer: zeroedu.grading.engines needs updating).")
            mine = [sum(r["losses"][s] for r in self.ranks[i]) / case.world_size for s in range(case.steps)]
            theirs = [sum(r["losses"][s] for r in self.ranks[j]) / case.world_size for s in range(case.steps)]
            for step, (a, b, c) in enumerate(zip(mine, theirs, self.refs[i]["losses"], strict=True)):
                if not math.isfinite(a):
                    raise AssertionError(f"{case.name}: the loss at step {step} is {a}: some weight decoded to nan or "
                                         "inf (a block of zeros divided by a zero scale?).")
                if abs(a - b) > 1e-3 * abs(b):
                    raise AssertionError(f"{case.name}: the loss at step {step} is {a:.6f} with your quantizer, "
                                         f"{b:.6f} with the engine's: the weights the forward used differ (each "
                                         "block's scale is max|x| / 127 of that block).")
                if abs(a - c) > 2e-2 * abs(c):
                    raise AssertionError(f"{case.name}: the loss at step {step} is {a:.6f}, unquantized training gets "
                                         f"{c:.6f}: more than 2% apart.")
            d, worst = dict_rel(self.ranks[i][0]["weights"], self.ranks[j][0]["weights"])
            if d > 1e-3:
                raise AssertionError(f"{case.name}: after {case.steps} steps the weights are {d:.2g} (relative) away "
                                     f"from the engine's own qwZ run, most of all {worst!r}: the forward computed "
                                     "with weights your functions decoded differently (each block's scale is "
                                     "max|x| / 127 of that block).")

    def check_bytes(self) -> None:
        """The parameter all-gathers send int8 codes plus one fp32 scale per block: the engine's own bytes."""
        for i, case, j in self._yours_with_pair():
            for step in range(case.steps):
                sa, sb = _gathers(self.ranks[i][0], step)[1], _gathers(self.ranks[j][0], step)[1]
                if sa != sb:
                    raise AssertionError(f"{case.name}, step {step}: the parameter all-gathers sent {sa} bytes, the "
                                         f"engine's qwZ sends {sb}: one int8 per weight and 4 bytes per block.")

    def table(self) -> str:
        if self.error:
            return f"{self.what} did not run: {self.error}"
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
    what = getattr(quantize, "__name__", "your quantizer")
    for fn, args in ((quantize, (torch.ones(8), 4)), (dequantize, (torch.ones(8, dtype=torch.int8), torch.ones(2), 4))):
        stub = in_kernel(not_implemented, fn, *args)
        if stub is not None:
            return QwzRun(what, cases, error=f"not implemented yet: {stub}")
    run = train_on_ranks(_qwz_engine(quantize, dequantize), cases, what=what, extra=_quant_calls)
    return QwzRun(run.what, run.cases, run.ranks, run.refs, run.error)


# == Exercise 7: the offload step =================================================================================

def _offload_engine(grad_to_host: Callable, host_step: Callable, params_to_device: Callable) -> Callable[[Case], type]:
    """The engine's offload class for the case, with the learner's three functions where OffloadMixin moves the
    gradient to the host (per bucket, in backward), steps Adam on the host, and writes the parameters back."""
    return functools.partial(_offload_class, grad_to_host, host_step, params_to_device)


class _RecordingOptimizer:
    """The engine's optimizer as the learner's host_step sees it: step() notes the .grad of every master piece
    (what the optimizer steps with), then steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list, stepped: list) -> None:
        self.optimizer, self.masters, self.stepped = optimizer, masters, stepped

    def step(self, *args, **kwargs):
        self.stepped.append([m.grad.detach().clone() if m.grad is not None else None for m in self.masters])
        return self.optimizer.step(*args, **kwargs)

    def __getattr__(self, name: str):   # param_groups, state, zero_grad: the engine's optimizer's
        return getattr(self.optimizer, name)


def _offload_class(grad_to_host: Callable, host_step: Callable, params_to_device: Callable, case: Case) -> type:
    from zeroedu.compose import engine_class
    from zeroedu.config import load_config

    base = engine_class(load_config(case.config(case.zero.get("stage", 2))))
    if case.engine != "yours":
        return base

    class YourOffload(base):
        def _count(self, name: str) -> None:
            calls = self.__dict__.setdefault("calls", {"grad_to_host": 0, "host_step": 0, "params_to_device": 0})
            calls[name] += 1

        def grad_to_host(self, b, staging, phase, step):
            self._count("grad_to_host")
            out = self.layout.piece_of_shard(self.host_grads, b)
            grad_to_host(out, staging, self.partitions_grads,
                         lambda dst, src: self.transfer(dst, src, "d2h", phase, step, sync=True))

        def host_step(self, grads, coef):
            self._count("host_step")
            stepped = self.__dict__.setdefault("stepped", [])
            host_step(grads, self.master_pieces, _RecordingOptimizer(self.optimizer, self.master_pieces, stepped),
                      coef)

        def write_back(self, b, master):
            if self.written_back:   # the stage's publish asks again: this step's pieces are home already
                return
            self._count("params_to_device")
            params_to_device(self.param_home(b), master.detach(), lambda dst, src: self.transfer(dst, src, "h2d"))

    base_name = base.__name__
    YourOffload.__name__ = YourOffload.__qualname__ = f"{base_name}WithYourStep"
    return YourOffload


def _offload_extra(engine: Any, case: Case) -> dict:
    return {"calls": getattr(engine, "calls", {}), "stepped": getattr(engine, "stepped", []),
            "shard_numel": engine.layout.shard_numel}


class OffloadRun(TrainRun):
    def bus_text(self, i: int = 0, step: int = 1) -> str:
        """Rank 0's copies between device and host in one step, by direction and dtype, next to its shard size."""
        self.ran()
        row = self.ranks[i][0]
        lines = [f"{self.cases[i].name}, rank 0, step {step}: shard of {row['shard_numel']} elements"]
        for op, what in (("d2h", "device -> host (gradients)"), ("h2d", "host -> device (parameters)")):
            by: dict[str, list[int]] = {}
            for e in row["ledger"]:
                if e["op"] == op and e["kind"] == "offload" and e["step"] == step:
                    k = by.setdefault(e["dtype"], [0, 0])
                    k[0] += 1
                    k[1] += e["sent_bytes"]
            moved = ", ".join(f"{n} copies of {d}, {b} bytes" for d, (n, b) in sorted(by.items())) or "nothing"
            lines.append(f"  {what:<28} {moved}")
        return "\n".join(lines)

    def check_calls(self, i: int) -> None:
        calls = self.ranks[i][0]["calls"]
        missing = [k for k in ("grad_to_host", "host_step", "params_to_device") if not calls.get(k)]
        if missing:
            raise AssertionError(f"{self.cases[i].name}: the engine never called your {', '.join(missing)} (it no "
                                 "longer calls the place zeroedu.grading.engines plugs into: update the adapter).")

    def check_step(self) -> None:
        """Adam on the host stepped with the reduced gradient times coef (unscaled and clipped), as fp32."""
        self.ran()
        for i, case in enumerate(self.cases):
            if case.engine != "yours":
                continue
            self.check_calls(i)
            rows, ref = self.ranks[i], self.refs[i]
            tol = TOLERANCE[case.precision]
            for step in range(case.steps):
                pieces = [r["stepped"][step] for r in rows]
                if any(g is None for p in pieces for g in p):
                    raise AssertionError(f"{case.name}, step {step}: a master piece had no .grad when the optimizer "
                                         "stepped: set master.grad for every piece before optimizer.step().")
                bad = [str(g.dtype) for p in pieces for g in p if g.dtype != torch.float32]
                if bad:
                    raise AssertionError(f"{case.name}, step {step}: the optimizer stepped with {bad[0]} gradients; "
                                         "the fp32 master weights take fp32 gradients: convert with .float().")
                got = assemble_full(rows[0]["layout"], pieces, True)
                grads = ref["grads"][step]
                coef = 1.0
                if case.clip > 0:
                    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
                    coef = min(1.0, case.clip / (norm + 1e-6))
                want = {k: v * coef for k, v in grads.items()}
                d, worst = dict_rel(got, want)
                if d <= tol:
                    continue
                if dict_rel(got, grads)[0] <= tol and coef < 1:
                    raise AssertionError(f"{case.name}, step {step}: the optimizer stepped with the reduced gradient "
                                         f"as it is; multiply it by coef (here {coef:.3g}: gradient clipping, and the "
                                         "fp16 loss scale when there is one).")
                raise AssertionError(f"{case.name}, step {step}: the gradient the optimizer stepped with is {d:.2g} "
                                     f"(relative) away from the clipped gradient of the whole batch, most of all "
                                     f"{worst!r}.")

    def check_bytes(self) -> None:
        """Per step and rank, across the bus: the gradient shard to the host, and the parameters back, each in the
        compute dtype (2 bytes per element in bf16); the fp32 master and Adam's state never cross."""
        self.ran()
        for i, case in enumerate(self.cases):
            if case.engine != "yours":
                continue
            self.check_calls(i)
            row = self.ranks[i][0]
            elem = _itemsize(row["dtype"])
            shard = row["shard_numel"]
            times = case.accum if row["stage"] >= 2 else 1
            for step in range(case.steps):
                d2h, h2d = ([e for e in row["ledger"] if e["op"] == op and e["kind"] == "offload" and e["step"] == step]
                            for op in ("d2h", "h2d"))
                for what, entries, k, fix in (
                        ("gradients to the host (d2h)", d2h, times,
                         "copy the reduced piece as it is (compute dtype) and convert on the host"),
                        ("parameters to the device (h2d)", h2d, 1,
                         "cast the fp32 master to the compute dtype on the host, then copy")):
                    want = k * shard * elem
                    sent = sum(e["sent_bytes"] for e in entries)
                    if sent != want:
                        dtypes = sorted({e["dtype"] for e in entries})
                        raise AssertionError(
                            f"{case.name}, step {step}: {sent} bytes of {what} in {len(entries)} copies of "
                            f"{', '.join(dtypes) or 'nothing'}; expected {want}: this rank's shard of {shard} elements "
                            f"in {row['dtype']} ({elem} bytes each)" + (f", once per micro-step ({k})" if k > 1
                                                                         else "") + f". {fix.capitalize()}.")


def _no_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy function a stub probe is given: it must never get that far."""


def run_offload(grad_to_host: Callable, host_step: Callable, params_to_device: Callable,
                cases: list[Case]) -> OffloadRun:
    """Train with offload_optimizer "cpu" and the learner's three functions; reference: one process."""
    what = "your offload step"
    probes = ((grad_to_host, (torch.zeros(2), torch.zeros(2), False, _no_copy)),
              (host_step, ([], [], None, 1.0)),
              (params_to_device, (torch.zeros(2), torch.zeros(2), _no_copy)))
    for fn, args in probes:
        stub = in_kernel(not_implemented, fn, *args)
        if stub is not None:
            return OffloadRun(what, cases, error=f"not implemented yet: {stub}")
    run = train_on_ranks(_offload_engine(grad_to_host, host_step, params_to_device), cases, what=what,
                         extra=_offload_extra)
    return OffloadRun(run.what, run.cases, run.ranks, run.refs, run.error)


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
        raise AssertionError(f"quantize_blocks returned {type(got).__name__}; return a tuple (codes, scales) of "
                             "two tensors")
    codes, scales = got
    nb = math.ceil(x.shape[-1] / block)
    where = f"quantize_blocks(x of shape {list(x.shape)}, block={block})"
    if codes.dtype != torch.int8 or codes.shape != x.shape:
        raise AssertionError(f"{where} returned codes of {codes.dtype}{list(codes.shape)}; return int8 codes shaped "
                             f"like x: one byte per element is the point of qwZ.")
    if scales.dtype != torch.float32:
        raise AssertionError(f"{where} returned {scales.dtype} scales; return float32 scales.")
    if scales.shape != (*x.shape[:-1], nb):
        last = x.shape[-1] - (nb - 1) * block
        raise AssertionError(f"{where} returned scales of shape {list(scales.shape)}; expected "
                             f"{[*x.shape[:-1], nb]}: one scale per block, ceil({x.shape[-1]} / {block}) = {nb} "
                             f"blocks" + (f", the last one holding only {last} elements." if last != block else "."))
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
        hint = (" That is the scale of the whole tensor: each block needs its own." if abs(float(scales[k]) - overall)
                <= 1e-6 * overall else "")
        if float(scales[k]) != 0 and abs(float(scales[k]) * 127 - float(want[k])) <= 1e-5 * float(want[k]):
            hint = " It is 1/127 of what it should be: the scale is max|x| / 127, so that codes reach +-127."
        first = k[-1] * block
        raise AssertionError(f"block {k[-1]} (elements {first} to {min(first + block, x.shape[-1]) - 1}"
                             f"{', row ' + str(k[0]) if len(k) > 1 else ''}) has scale {float(scales[k]):.6g}, "
                             f"expected max|x| over the block / 127 = {float(want[k]):.6g}.{hint}")


def _compare_codes(x: torch.Tensor, block: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    per = scales.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]
    safe = torch.where(per > 0, per, torch.ones_like(per))
    exact = torch.where(per > 0, x / safe, torch.zeros_like(x))
    off = (codes.float() - exact).abs()
    bad = off > 0.5 + 1e-3
    if bool(bad.any()):
        k = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"element {k[-1]}: x = {float(x[k]):.6g}, scale = {float(per[k]):.6g}, code "
                             f"{int(codes[k])}; round(x / scale) = {round(float(exact[k]))}. Codes are x / scale "
                             "rounded to the nearest integer (torch.round), then clamped to [-127, 127].")


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
            why = (" That is the scale of the whole tensor: each block needs its own, and a block of zeros gets 0."
                   if abs(float(scales[k]) - overall) <= 1e-6 * overall else
                   " Divide only where the scale is not 0 (torch.where), without adding an epsilon to the scale.")
            raise AssertionError(f"a block of zeros (block {k} of x with {n} elements, block={block}) got scale "
                                 f"{float(scales[k]):.3g} and codes {codes[zero].tolist()}; expected scale 0 and "
                                 f"codes 0.{why}")
        back = dequantize(codes, scales, block)
        if not bool(torch.isfinite(back).all()) or bool((back[zero] != 0).any()):
            raise AssertionError(f"dequantize_blocks decoded a block of zeros to {back[zero].tolist()}; it must give "
                                 "exact zeros (code 0 times scale 0).")
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
            raise AssertionError(f"dequantize_blocks returned {what} for codes of shape {list(codes.shape)}; "
                                 "return float32 values shaped like the codes.")
        per = scales.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]
        want = codes.float() * per
        if not torch.allclose(back, want, rtol=1e-6, atol=0):
            k = tuple(int(v) for v in (~torch.isclose(back, want, rtol=1e-6, atol=0)).nonzero()[0])
            raise AssertionError(f"x of shape {list(x.shape)}, block={block}: element {list(k)} decoded to "
                                 f"{float(back[k]):.6g}, but its code {int(codes[k])} times its block's scale "
                                 f"{float(per[k]):.6g} is {float(want[k]):.6g}. Each element uses the scale of its "
                                 "own block (and its own row).")
        err = float(((back - x).abs() - per / 2).max())
        if err > 1e-6 * float(x.abs().max()):
            raise AssertionError(f"x of shape {list(x.shape)}, block={block}: an element decodes more than half a "
                                 "scale away from x.")
