"""Exercise 7 (ex07_offload_step): the learner's three offload functions in the real engine, and their checks.

The learner writes grad_to_host, host_step and params_to_device; the engine's offload class calls them where
OffloadMixin moves the gradient to the host, steps Adam there, and writes the parameters back, on real gloo
ranks (zeroedu.grading.exercises.training). OffloadRun checks the step and the bytes that crossed the bus.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from zeroedu.grading.exercises.learner_code import _itemsize
from zeroedu.grading.exercises.ranks import not_implemented
from zeroedu.grading.exercises.training import TOLERANCE, Case, TrainRun, assemble_full, dict_rel, train_on_ranks
from zeroedu.grading.remote import in_kernel
from zeroedu.i18n import tr


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
            names = ", ".join(missing)
            raise AssertionError(tr(f"{self.cases[i].name}: the engine never called your {names} (it no "
                                    "longer calls the place zeroedu.grading.exercises.offload_step plugs into: update "
                                    "the adapter).",
                                    f"{self.cases[i].name}：引擎从未调用你的 {names}（引擎不再调用 "
                                    "zeroedu.grading.exercises.offload_step 接入的位置：需要更新这个适配器）。"))

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
                    raise AssertionError(tr(f"{case.name}, step {step}: a master piece had no .grad when the "
                                            "optimizer stepped: set master.grad for every piece before "
                                            "optimizer.step().",
                                            f"{case.name}，第 {step} 步：优化器 step 时有一块 fp32 主权重没有 .grad："
                                            "在 optimizer.step() 之前给每一块都设好 master.grad。"))
                bad = [str(g.dtype) for p in pieces for g in p if g.dtype != torch.float32]
                if bad:
                    raise AssertionError(tr(f"{case.name}, step {step}: the optimizer stepped with {bad[0]} "
                                            "gradients; the fp32 master weights take fp32 gradients: convert with "
                                            ".float().",
                                            f"{case.name}，第 {step} 步：优化器用 {bad[0]} 梯度做了 step；"
                                            "fp32 主权重要配 fp32 梯度：用 .float() 转换。"))
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
                    raise AssertionError(tr(f"{case.name}, step {step}: the optimizer stepped with the reduced "
                                            f"gradient as it is; multiply it by coef (here {coef:.3g}: gradient "
                                            "clipping, and the fp16 loss scale when there is one).",
                                            f"{case.name}，第 {step} 步：优化器直接用归约后的梯度做了 step；"
                                            f"要先乘以 coef（这里是 {coef:.3g}：梯度裁剪，以及 fp16 时的损失缩放）。"))
                raise AssertionError(tr(f"{case.name}, step {step}: the gradient the optimizer stepped with is "
                                        f"{d:.2g} (relative) away from the clipped gradient of the whole batch, most "
                                        f"of all {worst!r}.",
                                        f"{case.name}，第 {step} 步：优化器用的梯度与整个 batch 裁剪后的梯度相差 "
                                        f"{d:.2g}（相对误差），差得最多的是 {worst!r}。"))

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
                        (tr("gradients to the host (d2h)", "拷到 host 的梯度（d2h）"), d2h, times,
                         tr("copy the reduced piece as it is (compute dtype) and convert on the host",
                            "把归约后的那一块原样（计算 dtype）拷过去，在 host 上再转换")),
                        (tr("parameters to the device (h2d)", "拷回 device 的参数（h2d）"), h2d, 1,
                         tr("cast the fp32 master to the compute dtype on the host, then copy",
                            "先在 host 上把 fp32 主权重转成计算 dtype，再拷贝"))):
                    want = k * shard * elem
                    sent = sum(e["sent_bytes"] for e in entries)
                    if sent != want:
                        dtypes = sorted({e["dtype"] for e in entries})
                        raise AssertionError(tr(
                            f"{case.name}, step {step}: {sent} bytes of {what} in {len(entries)} copies of "
                            f"{', '.join(dtypes) or 'nothing'}; expected {want}: this rank's shard of {shard} elements "
                            f"in {row['dtype']} ({elem} bytes each)" + (f", once per micro-step ({k})" if k > 1
                                                                         else "") + f". {fix.capitalize()}.",
                            f"{case.name}，第 {step} 步：{what}共 {sent} 字节，{len(entries)} 次拷贝，dtype 为 "
                            f"{', '.join(dtypes) or '无'}；应为 {want} 字节：本 rank 的 {shard} 个元素的分片，"
                            f"{row['dtype']}（每个 {elem} 字节）" + (f"，每个微批次一次（{k} 次）" if k > 1 else "")
                            + f"。{fix}。"))


def _no_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy function a stub probe is given: it must never get that far."""


def run_offload(grad_to_host: Callable, host_step: Callable, params_to_device: Callable,
                cases: list[Case]) -> OffloadRun:
    """Train with offload_optimizer "cpu" and the learner's three functions; reference: one process."""
    what = tr("your offload step", "你的 offload step")
    probes = ((grad_to_host, (torch.zeros(2), torch.zeros(2), False, _no_copy)),
              (host_step, ([], [], None, 1.0)),
              (params_to_device, (torch.zeros(2), torch.zeros(2), _no_copy)))
    for fn, args in probes:
        stub = in_kernel(not_implemented, fn, *args)
        if stub is not None:
            return OffloadRun(what, cases, error=tr(f"not implemented yet: {stub}", f"尚未实现：{stub}"))
    run = train_on_ranks(_offload_engine(grad_to_host, host_step, params_to_device), cases, what=what,
                         extra=_offload_extra)
    return OffloadRun(run.what, run.cases, run.ranks, run.refs, run.error)
