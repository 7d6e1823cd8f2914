"""What training scripts call on DeepSpeed's engine, on zeroedu's: a mixin of Engine (zeroedu.engine).

Each method behaves as DeepSpeedEngine's does in deepspeed 0.19.8 (deepspeed/runtime/engine.py), and
tests/test_engine_facade.py runs the same calls on DeepSpeed itself on CPU gloo ranks and compares:

- `module`, `parameters()`, `named_parameters()`: the model's. DeepSpeed's engine is an nn.Module holding the
  model as its submodule `module`, so its own names carry the prefix "module."; so do these.
- `state_dict()` / `load_state_dict()`: the engine's, keys "module.<name>" as DeepSpeed's nn.Module gives. At
  ZeRO-3 DeepSpeed's returns the empty placeholders of partitioned parameters; zeroedu's gathers them (every rank
  gets the whole model). `load_state_dict` writes the fp32 master weights too, so the next step starts from the
  loaded weights at every stage (DeepSpeed's, at stages 1-3, sets the module's weights only, and its optimizer's
  master copy overwrites them at the next step).
- `zero_grad()`: clears every parameter's gradient, as DeepSpeed's (which sets .grad to None; at stages 0-1,
  where .grad is a view of zeroedu's flat gradient buffer, the view is zeroed instead).
- `global_steps` (optimizer steps, skipped ones included), `global_samples`, `zero_optimization_stage()`,
  `get_global_grad_norm()` (the norm of the last step, None before it or when nothing needed it).
- `train()` / `eval()`: the module's mode.
- `no_sync()`: gradients accumulate without being reduced; DeepSpeed refuses it at stages 2-3, whose gradients
  are partitioned as they are reduced, and refuses engine.step() inside it; so does zeroedu.

Why the engine is not an nn.Module as DeepSpeed's is: nn.Module's __setattr__ would register every tensor,
module and parameter list the engine keeps (master pieces, bucket buffers, ZeRO-3's units) as the engine's own,
so `parameters()` and `state_dict()` would report the optimizer's fp32 copies beside the model's; DeepSpeed hides
its own by keeping them outside the module tree. The surface scripts use is here instead; `isinstance(engine,
torch.nn.Module)` is the one thing that differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def half_inputs(inputs: Any) -> Any:
    """fp16.auto_cast: every floating-point tensor in `inputs` (nested lists, tuples, dicts) cast to fp16, as
    DeepSpeed's engine casts the forward's positional inputs (`_cast_inputs_half`)."""
    if isinstance(inputs, list | tuple):
        return type(inputs)(half_inputs(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: half_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs


class DeepSpeedFacade:
    """DeepSpeedEngine's public surface beyond initialize/forward/backward/step (see the module docstring)."""

    inside_no_sync = False
    _decay_runs: list[list[tuple[int, int, float]]] | None = None

    # -- per-parameter weight decay (parameter groups that differ in weight_decay) ---------------------------
    def group_decay(self, pieces: list[int]) -> None:
        """Weight decay per parameter on master pieces `pieces`, just before the optimizer (built with weight
        decay 0) steps them; Engine.optimizer_step calls it. Groups that differ in weight_decay tag each parameter
        with its own (zeroedu.client); without tags this does nothing. AdamW decays decoupled, as torch's AdamW
        does first in its step (weight x (1 - lr x wd)); Adam and SGD add wd x weight to the gradient (L2), as
        theirs do. Each parameter's run of a piece gets its own group's factor, so this is the same arithmetic."""
        if self._decay_runs is None:
            self._decay_runs = self._decay_layout()
        if not self._decay_runs:
            return
        decoupled = self.config.optimizer.type == "AdamW"
        lr = float(self.optimizer.param_groups[0]["lr"])
        for i in pieces:
            piece = self.master_pieces[i]
            for s, e, wd in self._decay_runs[i]:
                if wd == 0.0:
                    continue
                if decoupled:
                    piece.data[s:e].mul_(1 - lr * wd)
                elif piece.grad is not None:
                    piece.grad[s:e].add_(piece.data[s:e], alpha=wd)

    def _decay_layout(self) -> list[list[tuple[int, int, float]]]:
        """For each master piece, (start, end, weight decay) of each tagged parameter's part of it; [] if no
        parameter is tagged."""
        from zeroedu.client import DECAY_ATTR

        if not any(hasattr(p, DECAY_ATTR) for p in self.layout.params):
            return []
        runs = []
        for b in self.layout.buckets:
            # From the layout, not the piece's storage: offload at nvme empties the pieces between steps.
            lo = self.rank * b.piece if self.sharded else 0
            hi = lo + (b.piece if self.sharded else b.padded)
            mine = []
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
                s, e = max(lo, off), min(hi, off + shape.numel())
                if s < e:
                    mine.append((s - lo, e - lo, float(getattr(p, DECAY_ATTR, 0.0))))
            runs.append(mine)
        return runs

    # -- the model ---------------------------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        start = f"{prefix}.module" if prefix else "module"
        return self.module.named_parameters(start, recurse, remove_duplicate)

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient cleared (DeepSpeed sets .grad to None, ignoring set_to_none). At stages 0-1
        a parameter's .grad is a view of the engine's flat gradient buffer, which backward accumulates into: it is
        zeroed in place, so the view stays (None would make autograd allocate a gradient the engine never sees)."""
        flat = getattr(self, "flat_grads", None)
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if flat is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                p.grad.zero_()
            else:
                p.grad = None

    # -- counters ----------------------------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.global_step

    @property
    def global_samples(self) -> int:
        return self.global_step * self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.stage

    def get_global_grad_norm(self) -> float | None:
        return self.last_grad_norm

    # -- state dicts -------------------------------------------------------------------------------------
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The module's state_dict under "module.", as DeepSpeed's engine (an nn.Module) returns it; at ZeRO-3
        gathered, so every rank holds the whole model (every rank must call it)."""
        from zeroedu import zero

        out = {} if destination is None else destination
        with zero.GatheredParameters(list(self.module.parameters()), enabled=self.stage == 3):
            for k, v in self.module.state_dict(keep_vars=keep_vars).items():
                out[f"{prefix}module.{k}"] = v if keep_vars else v.detach().clone()
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """Load weights saved by `state_dict()` (keys "module.<name>") or by the module itself (keys "<name>"):
        into the fp32 master weights (each rank its own pieces), then into the model, so training goes on from
        them at every stage. Every rank must call it with the same weights."""
        plain = {k.removeprefix("module."): v for k, v in state_dict.items()}
        names = {n for p in self.layout.params for n in [self.names[p]]}
        expected = set(self.module.state_dict().keys())
        missing, unexpected = sorted(expected - plain.keys()), sorted(plain.keys() - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} (keys are "
                               f"the module's, with or without the 'module.' prefix); pass strict=False to load "
                               f"the others.")
        master = [m.detach().float().cpu().clone() for m in self.checkpoint_master()]
        for i, (b, m) in enumerate(zip(self.layout.buckets, master, strict=True)):
            lo = 0 if m.numel() == b.padded else self.rank * b.piece   # stage 0 keeps whole buckets
            hi = lo + m.numel()
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
                name = self.names[p]
                if name not in plain:
                    continue
                src = plain[name].detach().reshape(-1).to("cpu", torch.float32)
                if src.numel() != shape.numel():
                    raise RuntimeError(f"load_state_dict: '{name}' has {src.numel()} elements, the model's "
                                       f"{shape.numel()} ({tuple(shape)}).")
                e0, e1 = max(lo, off) - off, min(hi, off + shape.numel()) - off
                if e0 < e1:
                    master[i][off + e0 - lo: off + e1 - lo].copy_(src[e0:e1])
        self.restore_checkpoint([m.to(t.device) for m, t in zip(master, self.checkpoint_master(), strict=True)],
                                None)
        with self.comm.in_phase("init"):
            self.publish()   # the model's weights from the master weights
            self.wait()
        rest = {k: v for k, v in plain.items() if k not in names and k in expected}
        if rest:   # buffers and frozen parameters, which the engine does not shard
            from zeroedu import zero

            with zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0,
                                         enabled=self.stage == 3 and any(
                                             not p.requires_grad for p in self.module.parameters())):
                self.module.load_state_dict(rest, strict=False)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    # -- gradient accumulation without communication -----------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients without reducing them; the next backward outside reduces the
        sum. As in DeepSpeed: not at stages 2-3 (gradients are partitioned as they are reduced), not nested,
        and engine.step() is an error inside."""
        if self.stage >= 2:
            raise RuntimeError(f"no_sync() cannot work at ZeRO stage {self.stage}: stages 2-3 partition gradients "
                               f"as they reduce them, so every backward must reduce (DeepSpeed refuses it too). Use "
                               f"gradient_accumulation_steps, which reduces once per optimizer step at stage 0-1 "
                               f"and keeps a 1/N gradient shard at stages 2-3.")
        if self.inside_no_sync:
            raise RuntimeError("no_sync() is already active: it cannot be nested (as in DeepSpeed).")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False
