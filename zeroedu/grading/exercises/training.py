"""Test harness for exercises 3-8: a learner's piece of the engine trains on real gloo ranks, and is compared with
a single-process run on the same global batch.

    cases = [Case("MLP, 2 ranks", model="mlp", world_size=2, zero={"reduce_bucket_size": 400})]
    run = train_on_ranks(engine_for_rank, cases, what="your stage 1")   # one launch per world size
    run.check_trains()      # losses, gradients and fp32 weights equal the single-process reference
    run.check_replicas()    # every rank's compute parameters equal the reference weights (all-gathered)

`engine_for_rank(case)` runs on each rank and returns the engine class to build: a zeroedu stage with the
learner's piece in it (a subclass the learner wrote, or an adapter in the exercise's module, such as
zeroedu.grading.exercises.offload_step, that calls the learner's function where the real engine calls its own). The
harness puts a thin recorder on top of that class: it notes the reduced gradient handed to the optimizer step, and
nothing else.

The reference (`reference(case)`) never touches the engine: the whole global batch in one process, fp32 master
weights stepped by torch's own optimizer, the compute-dtype model copied from them after each step, exactly as
mixed-precision training is written by hand. Each case fixes its data by (model, step), so every world size and
every stage sees the same global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zeroedu.comm.agreement import PAYLOAD_BYTES
from zeroedu.config import load_config
from zeroedu.fmt import approx
from zeroedu.grading.exercises.ranks import run_on_ranks
from zeroedu.grading.remote import in_kernel, wire_problem
from zeroedu.i18n import tr
from zeroedu.models import MLP, Quirky, TinyGPT, TinyGPTConfig, gpt_batch, mlp_batch, quirky_batch, shard_batch
from zeroedu.precision import DTYPES

__all__ = ["Case", "Quirky", "TrainRun", "make_batch", "make_model", "reference", "train_on_ranks"]

LOCAL_KINDS = ("offload", "activations")   # ledger kinds that copy within a rank (host <-> device): never on a wire
GPT = TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=1, n_head=2)
MLP_SIZES = (12, 24, 24, 6)


def make_model(name: str, seed: int = 0) -> nn.Module:
    if name == "mlp":
        return MLP(MLP_SIZES, seed=seed)
    if name == "gpt":
        return TinyGPT(GPT, seed=seed)
    if name == "quirky":
        return Quirky(seed)
    raise ValueError(tr(f"unknown model {name!r}: use 'mlp', 'gpt' or 'quirky'",
                        f"未知模型 {name!r}：请用 'mlp'、'gpt' 或 'quirky'"))


def make_batch(name: str, step: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (float inputs in the model's dtype)."""
    if name == "mlp":
        x, y = mlp_batch(step, n, MLP_SIZES)
        return x.to(dtype), y
    if name == "gpt":
        return gpt_batch(step, n, GPT)
    return quirky_batch(step, n)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


@dataclass(frozen=True)
class Case:
    """One training run: model, ranks, steps and the zero_optimization keys of the engine's config."""

    name: str
    model: str = "mlp"
    world_size: int = 2
    steps: int = 3
    accum: int = 1
    micro_batch: int = 2
    precision: str = "fp32"
    clip: float = 0.0
    optimizer: str = "Adam"
    lr: float = 1e-2
    zero: dict = field(default_factory=dict)
    engine: str = "yours"      # "yours": the class under test; "zeroedu": the engine's own, for comparison

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accum

    def config(self, stage: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accum,
            "gradient_clipping": self.clip,
            "optimizer": {"type": self.optimizer, "params": {"lr": self.lr}},
            "bf16": {"enabled": self.precision == "bf16"},
            "fp16": {"enabled": self.precision == "fp16"},
            "zero_optimization": {"stage": stage, "overlap_comm": False, **self.zero},
        }


# -- the reference: one process, the whole global batch ---------------------------------------------------------

def reference(case: Case) -> dict[str, Any]:
    """Losses, gradients of the global batch (fp32, per step) and weights after each step, in one process."""
    model = make_model(case.model).to(DTYPES[case.precision])
    named = list(dict(model.named_parameters()).items())          # a tied weight once, under its first name
    master = [p.detach().float().clone().requires_grad_(True) for _, p in named]
    opt_cls = {"Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[case.optimizer]
    opt = opt_cls(master, lr=case.lr)
    out: dict[str, Any] = {"losses": [], "grads": [], "micro_grads": [], "weights": [], "params": []}
    for step in range(case.steps):
        x, y = make_batch(case.model, step, case.global_batch, DTYPES[case.precision])
        out["micro_grads"].append(_micro_grads(model, named, case, x, y) if case.accum > 1 else [])
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        loss.backward()
        grads = [p.grad.float() if p.grad is not None else torch.zeros_like(q) for (_, p), q in zip(named, master,
                                                                                                     strict=True)]
        coef = 1.0
        if case.clip > 0:
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            coef = min(1.0, case.clip / (norm + 1e-6))
        for q, g in zip(master, grads, strict=True):
            q.grad = g * coef
        opt.step()
        with torch.no_grad():
            for (_, p), q in zip(named, master, strict=True):
                p.copy_(q)
        out["losses"].append(float(loss.detach()))
        out["grads"].append({n: g.clone() for (n, _), g in zip(named, grads, strict=True)})
        out["weights"].append({n: q.detach().clone() for (n, _), q in zip(named, master, strict=True)})
        out["params"].append({n: p.detach().clone() for n, p in named})
    return out


def _micro_grads(model: nn.Module, named: list, case: Case, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Each micro-step's share of the step's gradient (its slice of the global batch, divided by accum): what
    a rank would hold if only that micro-step's gradient reached the optimizer."""
    out = []
    k = case.global_batch // case.accum
    for micro in range(case.accum):
        model.zero_grad(set_to_none=True)
        (loss_of(model(x[micro * k:(micro + 1) * k]), y[micro * k:(micro + 1) * k]) / case.accum).backward()
        out.append({n: p.grad.float().clone() if p.grad is not None else torch.zeros(p.shape) for n, p in named})
    model.zero_grad(set_to_none=True)
    return out


# -- on the ranks ----------------------------------------------------------------------------------------------

class _Recorder:
    """Put on top of the engine class under test: keeps a copy of the gradient each optimizer step receives."""

    def optimizer_step(self, grads: list[torch.Tensor], coef: float) -> None:
        self.recorded_grads.append([g.detach().float().clone() / self.scaler.scale for g in grads])
        super().optimizer_step(grads, coef)


def _layout_rows(engine: Any) -> list[dict]:
    """Each bucket's place in the flat buffer and its parameters (name, offset, shape): the parent rebuilds full
    tensors from per-rank pieces with it."""
    return [dict(start=b.start, padded=b.padded, piece=b.piece,
                 params=[(engine.names[p], off, tuple(shape)) for p, off, shape in zip(b.params, b.offsets, b.shapes,
                                                                                      strict=True)])
            for b in engine.layout.buckets]


def _compute_params(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's compute-dtype parameters as they are now (stage 3: only those gathered now are non-empty)."""
    return {engine.names[p]: p.detach().clone() for p in engine.layout.params}


def _wire_claim(engine: Any, n: int) -> int:
    """The bytes this rank's engine says it sent to other ranks, as the grader will compare them with the wire:
    every collective in its ledger (the set-up's included) and each collective-agreement check known to be done
    (one all-gather of PAYLOAD_BYTES: (N-1) x PAYLOAD_BYTES from each rank, whatever gloo's algorithm). The more
    of an honest run's traffic is claimed, the less room a forged ledger has to hide in."""
    claim = sum(e.sent_bytes for e in engine.ledger if e.kind not in LOCAL_KINDS and e.group_size > 1)
    agreement = getattr(engine.comm, "agreement", None)
    if agreement is not None and n > 1:
        done = int(getattr(agreement, "checks", 0)) - len(getattr(agreement, "_pending", ()))
        claim += max(0, done) * (n - 1) * PAYLOAD_BYTES
    return int(claim)


def _job(rank: int, n: int, cases: list[Case], engine_for_rank: Callable, extra: Callable | None) -> list[dict]:
    out = []
    for case in cases:
        cls = engine_for_rank(case)
        cls = type(cls.__name__, (_Recorder, cls), {"recorded_grads": None})
        model = make_model(case.model)
        engine = cls(model, load_config(case.config(cls.stage)))
        engine.recorded_grads = []
        losses, params = [], []
        for step in range(case.steps):
            x, y = make_batch(case.model, step, case.global_batch, engine.dtype)
            total = 0.0
            for micro in range(case.accum):
                xb, yb = shard_batch(x, y, rank, n, micro, case.accum)
                loss = loss_of(engine(xb), yb)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach()) / case.accum
            losses.append(total)
            params.append(_compute_params(engine))
        row = dict(losses=losses, params=params, grads=engine.recorded_grads, sharded=engine.sharded,
                   layout=_layout_rows(engine), ledger=[e for e in engine.ledger.rows() if e["phase"] != "init"],
                   stage=engine.stage, dtype=str(engine.dtype).removeprefix("torch."))
        row["weights"] = engine.master_state_dict()
        row["wire_claim"] = _wire_claim(engine, n)
        if extra is not None:
            row.update(extra(engine, case))
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        dist.barrier()
        out.append(row)
    return out


def assemble_full(layout: list[dict], pieces_by_rank: list[list[torch.Tensor]],
                  sharded: bool) -> dict[str, torch.Tensor]:
    """{name: tensor} from the pieces each rank holds (sharded: rank r holds piece r of every bucket)."""
    numel = sum(b["padded"] for b in layout)
    full = torch.zeros(numel, dtype=pieces_by_rank[0][0].dtype)
    for i, b in enumerate(layout):
        if sharded:
            for r, pieces in enumerate(pieces_by_rank):
                full[b["start"] + r * b["piece"]: b["start"] + (r + 1) * b["piece"]] = pieces[i].reshape(-1)
        else:
            full[b["start"]: b["start"] + b["padded"]] = pieces_by_rank[0][i].reshape(-1)
    out = {}
    for b in layout:
        for name, off, shape in b["params"]:
            k = math.prod(shape)
            out[name] = full[b["start"] + off: b["start"] + off + k].reshape(shape)
    return out


# -- comparing ---------------------------------------------------------------------------------------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    out = num / den if den > 0 else num
    return out if math.isfinite(out) else math.inf   # NaN compares false with everything: never "close"


def dict_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The relative distance over all tensors together, and the name of the tensor that is furthest off."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    worst = max(b, key=lambda k: rel(a[k], b[k]))
    out = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    return (out if math.isfinite(out) else math.inf), worst   # a NaN anywhere is infinitely far


TOLERANCE = {"fp32": 1e-5, "bf16": 6e-2, "fp16": 1e-2}
"""Relative distance (all tensors together) allowed from the single-process run. bf16: gradients summed in 16 bits
over ranks and micro-steps differ from one process by up to 3% (measured: 0.3-2.9% on the cases here); the
mistakes the checks look for (a missing 1/N, a lost micro-step, stale weights) are off by 30% or more."""


@dataclass
class TrainRun:
    """Per case: what every rank did (`ranks[case index][rank]`) and the single-process reference."""

    what: str
    cases: list[Case]
    ranks: list[list[dict]] = field(default_factory=list)
    refs: list[dict] = field(default_factory=list)
    error: str | None = None

    def ran(self) -> None:
        if self.error:
            raise AssertionError(self.error)

    def grads(self, i: int, step: int) -> dict[str, torch.Tensor]:
        rows = self.ranks[i]
        return assemble_full(rows[0]["layout"], [r["grads"][step] for r in rows], rows[0]["sharded"])

    # -- checks --------------------------------------------------------------------------------------------------
    def check_trains(self) -> None:
        """Losses, the reduced gradient of every step and the fp32 weights equal the single-process run."""
        self.ran()
        for i, case in enumerate(self.cases):
            self._check_case(i, case)

    def _check_case(self, i: int, case: Case) -> None:
        rows, ref = self.ranks[i], self.refs[i]
        tol = TOLERANCE[case.precision]
        where = tr(f"{case.name}:", f"{case.name}：")
        steps = [len(r["grads"]) for r in rows]
        if steps[0] != case.steps:
            raise AssertionError(tr(f"{where} the optimizer stepped {steps[0]} times in {case.steps} steps "
                                    f"of {case.accum} micro-step(s); it steps once per accumulation boundary.",
                                    f"{where}{case.steps} 步（每步 {case.accum} 个微批次）里优化器 step 了 "
                                    f"{steps[0]} 次；"
                                    "它应该在每个梯度累积边界 step 一次。"))
        for step in range(case.steps):
            got, want = self.grads(i, step), ref["grads"][step]
            d, worst = dict_rel(got, want)
            if d > tol:
                before = self.replica_problem(i, step - 1) if step > 0 else None
                if before:
                    raise AssertionError(tr(f"{where} {before} So step {step} computed its gradient with wrong "
                                            "weights.", f"{where}{before} 所以第 {step} 步是用错误的权重算的梯度。"))
                raise AssertionError(where + tr(" ", "") + self.diagnose_grads(i, step, got, want, worst, d))
        losses = [sum(r["losses"][s] for r in rows) / len(rows) for s in range(case.steps)]
        for step, (a, b) in enumerate(zip(losses, ref["losses"], strict=True)):
            if not abs(a - b) <= tol * max(1.0, abs(b)):   # NaN-safe: a NaN loss fails
                raise AssertionError(tr(f"{where} the loss at step {step} is {a:.6f} averaged over ranks, one "
                                        f"process on the whole batch gets {b:.6f}.",
                                        f"{where}第 {step} 步各 rank 平均的 loss 是 {a:.6f}，单进程跑整个 batch "
                                        f"得到 {b:.6f}。"))
        d, worst = dict_rel(rows[0]["weights"], ref["weights"][-1])
        if d > tol:
            raise AssertionError(tr(f"{where} after {case.steps} steps the fp32 master weights are {d:.2g} "
                                    f"(relative) away from the single-process run's, most of all {worst!r}, although "
                                    "the gradients were right: the optimizer step or the master weights went wrong.",
                                    f"{where}{case.steps} 步之后，fp32 主权重与单进程的结果相差 {d:.2g}（相对误差），"
                                    f"差得最多的是 {worst!r}，而梯度是对的：问题出在优化器 step 或 fp32 主权重上。"))

    def diagnose_grads(self, i: int, step: int, got: dict, want: dict, worst: str, d: float) -> str:
        case = self.cases[i]
        n, tol = case.world_size, TOLERANCE[case.precision]
        zh_head = f"第 {step} 步优化器拿到的梯度"
        ratio = _scale_of(got, want, tol)
        if ratio is not None and n > 1 and abs(ratio - n) < 1e-2 * n:
            return tr(f"at step {step} the gradient the optimizer received is {n} times the gradient of the whole "
                      f"batch: it is the sum over the {n} ranks. "
                      "Average it: divide by N (average=True).",
                      f"{zh_head}是整个 batch 梯度的 {n} 倍：它是 {n} 个 rank 的总和。"
                      "要取平均：除以 N（average=True）。")
        for k, c in enumerate((1, n)):
            for m, micro in enumerate(self.refs[i]["micro_grads"][step]):
                scaled = {k: v * c for k, v in micro.items()}
                if dict_rel(got, scaled)[0] <= max(tol, 1e-4):
                    return tr(f"at step {step} the gradient the optimizer received is only micro-step {m + 1}'s "
                              f"share of it (of {case.accum})"
                              f"{(', and ' + str(n) + ' times too big (divide by N)') if k else ''}: the other "
                              "micro-steps' reduced gradients were lost. Accumulate: add each micro-step's reduced "
                              "gradient into the shard, do not overwrite it.",
                              f"{zh_head}只是第 {m + 1} 个微批次（共 {case.accum} 个）的那一份"
                              f"{f'，而且大了 {n} 倍（要除以 N）' if k else ''}：其他微批次"
                              "归约后的梯度丢了。要累积：把每个微批次归约后的梯度加到分片上，而不是覆盖。")
        zero = [k for k in want if float(got[k].abs().max()) == 0 and float(want[k].abs().max()) > 0]
        if zero:
            names = ", ".join(repr(k) for k in zero[:3])
            return tr(f"at step {step} the gradient the optimizer received is zero for {names}: these gradients "
                      "never reached the "
                      "optimizer (was their bucket reduced?).",
                      f"{zh_head}在 {names} 上是 0：这些梯度没有到达优化器（它们的桶归约了吗？）。")
        return tr(f"at step {step} the gradient the optimizer received is {d:.2g} (relative) away from the "
                  "gradient of the whole batch in one process, most of "
                  f"all for {worst!r}.",
                  f"{zh_head}与单进程整个 batch 的梯度相差 {d:.2g}（相对误差），差得最多的是 {worst!r}。")

    def check_replicas(self) -> None:
        """After every step, every rank's compute-dtype parameters equal the reference weights."""
        self.ran()
        for i, case in enumerate(self.cases):
            for step in range(case.steps):
                problem = self.replica_problem(i, step)
                if problem:
                    raise AssertionError(tr(f"{case.name}: {problem}", f"{case.name}：{problem}"))

    def replica_problem(self, i: int, step: int) -> str | None:
        """What is wrong with some rank's compute parameters after `step`, or None (also when a stage keeps no
        full parameters between steps). Replicas must be identical on every rank, bit for bit, and equal to the
        single-process run's weights up to the precision's tolerance."""
        case, ref = self.cases[i], self.refs[i]
        rows = self.ranks[i]
        if any(t.numel() == 0 for t in rows[0]["params"][step].values()):
            return None
        want = ref["params"][step]
        for rank, row in enumerate(rows):
            got = row["params"][step]
            differs = [k for k in got if not torch.equal(got[k], rows[0]["params"][step][k])]
            d, worst = dict_rel(got, want)
            if differs or d > TOLERANCE[case.precision]:
                name = max(differs, key=lambda k: rel(got[k], want[k])) if differs else worst
                return tr(f"after step {step}, rank {rank}'s parameter {name!r} is not the updated one"
                          + ("" if not differs or rank == 0 else " (it differs from rank 0's)"),
                          f"第 {step} 步之后，rank {rank} 的参数 {name!r} 不是更新后的值"
                          + ("" if not differs or rank == 0 else "（与 rank 0 的不同）")
                          ) + self._stale(i, rank, step, name)
        return None

    def _stale(self, i: int, rank: int, step: int, name: str) -> str:
        """For a rank whose parameters are not the updated ones: were its own pieces updated, the others', or
        neither? (Each rank owns piece r of every bucket of the flat buffer.)"""
        case, row = self.cases[i], self.ranks[i][rank]
        before = self.refs[i]["params"][step - 1] if step > 0 else _initial(case)
        want = self.refs[i]["params"][step]
        own, other = [], []          # did the elements the step moved change on this rank? its own, the others
        for b in row["layout"]:
            for pname, off, _ in b["params"]:
                changed = (row["params"][step][pname].double() - before[pname].double()).reshape(-1) != 0
                moved = (want[pname].double() - before[pname].double()).reshape(-1) != 0
                where = torch.arange(off, off + changed.numel())
                mine = (where // b["piece"] == rank) if row["sharded"] else torch.ones_like(moved)
                own += changed[moved & mine].tolist()
                other += changed[moved & ~mine].tolist()
        if own and other and any(own) and not any(other):
            return tr(": the elements this rank owns were updated, the others still hold their values from before "
                      "the step. Each rank steps only its own piece; the other ranks' pieces reach it only through "
                      "the all-gather after the step.",
                      "：本 rank 持有的元素更新了，其余元素还是 step 之前的值。每个 rank 只 step 自己那一块；"
                      "其他 rank 的那几块只能通过 step 之后的 all-gather 拿到。")
        if own and not any(own) and not any(other):
            return tr(": none of its elements changed in the step. The updated fp32 master weights must be copied "
                      "into the compute-dtype parameters (and, when sharded, all-gathered).",
                      "：这一步里它的元素一个都没变。更新后的 fp32 主权重必须拷回计算 dtype 的参数"
                      "（分片时还要 all-gather）。")
        return tr(".", "。")

    def table(self) -> str:
        if self.error:
            return tr(f"{self.what} did not run: {self.error}", f"{self.what} 没有跑起来：{self.error}")
        w = max(len(c.name) for c in self.cases) + 2
        lines = [f"{'case':<{w}} {'step':>4} {'loss (ranks)':>13} {'loss (1 process)':>17}"]
        for i, case in enumerate(self.cases):
            rows, ref = self.ranks[i], self.refs[i]
            for s in range(case.steps):
                loss = sum(r["losses"][s] for r in rows) / len(rows)
                ours, theirs = approx(loss, 5), approx(ref["losses"][s], 5)
                lines.append(f"{case.name if s == 0 else '':<{w}} {s:>4} {ours:>13} {theirs:>17}")
        return "\n".join(lines)

    def sent(self, i: int, rank: int, op: str, kind: str, step: int | None = None) -> int:
        return sum(e["sent_bytes"] for e in self.ranks[i][rank]["ledger"]
                   if e["op"] == op and e["kind"] == kind and (step is None or e["step"] == step))


def _initial(case: Case) -> dict[str, torch.Tensor]:
    model = make_model(case.model).to(DTYPES[case.precision])
    return {n: p.detach().clone() for n, p in dict(model.named_parameters()).items()}


def _scale_of(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> float | None:
    """The c with got = c * want, if there is one (least squares, then checked)."""
    num = sum(float((got[k].double() * want[k].double()).sum()) for k in want)
    den = sum(float(want[k].double().pow(2).sum()) for k in want)
    if den == 0:
        return None
    c = num / den
    resid = math.sqrt(sum(float((got[k].double() - c * want[k].double()).pow(2).sum()) for k in want) / den)
    return c if resid < max(1e-3, tol) * max(1.0, abs(c)) else None


def _collect(cases: list[Case], engine_for_rank: Callable, extra: Callable | None, what: str) -> dict:
    """In the kernel: every case trained on its ranks, one launch per world size; {"rows": [case][rank]} or the
    failure in plain words. No reference here: that is computed where the checks run."""
    rows: dict[int, list] = {}
    try:
        for n in sorted({c.world_size for c in cases}):
            mine = [i for i, c in enumerate(cases) if c.world_size == n]
            per_rank = run_on_ranks(_job, n, args=([cases[i] for i in mine], engine_for_rank, extra), what=what)
            for k, i in enumerate(mine):
                rows[i] = [per_rank[r][k] for r in range(n)]
    except AssertionError as e:
        return {"error": str(e)}
    return {"rows": [rows[i] for i in range(len(cases))]}


def ledger_claim(rows_by_case: list[list[dict]]) -> int:
    """Bytes the ranks say went to other ranks, summed over ranks and cases, for the grader's cross-check against
    the wire: each rank's wire_claim (_wire_claim), and never less than the ledger rows it returned claim (a
    wire_claim made smaller cannot hide forged rows). Values that are not numbers claim nothing (the checks fail
    on them)."""
    total = 0
    for rows in rows_by_case:
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, dict):
                continue
            ledger = sum(e["sent_bytes"] for e in row.get("ledger", []) if isinstance(e, dict)
                         and isinstance(e.get("sent_bytes"), int) and e.get("kind") not in LOCAL_KINDS
                         and isinstance(e.get("group_size"), int) and e["group_size"] > 1)
            claim = row.get("wire_claim")
            total += max(ledger, claim if isinstance(claim, int) else 0)
    return total


def train_on_ranks(engine_for_rank: Callable[[Case], type], cases: list[Case], what: str | None = None,
                   extra: Callable | None = None, ref: bool = True) -> TrainRun:
    """Train every case with the class engine_for_rank(case) returns, one launch per world size, next to the
    learner's code (in_kernel); the reference runs where this is called. extra(engine, case) -> dict adds
    exercise-specific measurements to each rank's row. Under the grader, engine_for_rank and extra must pickle
    (module-level functions, functools.partial of them)."""
    what = what or tr("your code", "你的代码")
    run = TrainRun(what, list(cases))
    # The learner's cases and the engine's own (engine="zeroedu", for comparison) run in separate requests: the
    # wire counted during each must cover the bytes its own ranks claim, and the engine's honest traffic must not
    # cover for the learner's.
    groups = [[i for i, c in enumerate(cases) if (c.engine == "yours") == mine] for mine in (True, False)]
    rows: dict[int, list] = {}
    for group in (g for g in groups if g):
        out = in_kernel(_collect, [cases[i] for i in group], engine_for_rank, extra, what)
        if "error" in out:
            run.error = str(out["error"])
            return run
        problem = wire_problem(ledger_claim(out["rows"]), what,
                               tr("their ledgers' collectives and the engine's checks",
                                  "来自通信账本（ledger）里的集合通信和引擎自己的校验"))
        if problem:
            run.error = problem
            return run
        rows.update(zip(group, out["rows"], strict=True))
    run.ranks = [rows[i] for i in range(len(cases))]
    run.refs = [reference(c) if ref else {} for c in cases]
    return run
