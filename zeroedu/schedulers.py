"""DeepSpeed's learning-rate schedules, as the config's `scheduler` section names them.

`{"scheduler": {"type": "WarmupLR", "params": {...}}}` builds one of the classes below over the engine's
optimizer, and `engine.step()` steps it once per optimizer step (not per micro-step, and not on a step that fp16
skipped for overflow), as DeepSpeed's engine does. Each schedule is a function of `last_batch_iteration`, the
number of optimizer steps taken minus one: -1 before the first step, 0 right after it. So with the log warmup the
learning rate after the first step is still the minimum (ln 1 = 0).

The formulas are DeepSpeed's (deepspeed/runtime/lr_schedules.py, documented at
https://deepspeed.readthedocs.io/en/latest/schedulers.html), written here from them; tests/test_schedulers.py
compares every step against DeepSpeed's own classes. One DeepSpeed quirk is kept on purpose: OneCycle with a
betas optimizer (Adam, AdamW) cycles beta1 and sets beta2 to 0.99.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Each schedule's parameters and their defaults (None: required). The config checks keys against these.
PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": "optimizer lr", "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
}
# Parameters that are step counts (integers) and switches (booleans); the rest are numbers, except warmup_type.
COUNTS = {"warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
          "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "lr_range_test_step_size",
          "last_batch_iteration"}
SWITCHES = {"cycle_momentum", "lr_range_test_staircase"}


class Schedule:
    """Sets every parameter group's lr (and for OneCycle beta1) from `last_batch_iteration`."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration

    def lr(self) -> float:
        raise NotImplementedError

    def momentum(self) -> float | None:
        return None

    def _apply(self) -> None:
        lr, mom = self.lr(), self.momentum()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if mom is not None:
                group["betas"] = (mom, 0.99)

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def get_lr(self) -> list[float]:
        return [self.lr() for _ in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])


def _warmup_fraction(it: int, steps: int, kind: str) -> float:
    """0 -> 1 over the warmup: ln(it + 1) / ln(steps), or it / steps."""
    return (1.0 / math.log(steps)) * math.log(it + 1) if kind == "log" else it / steps   # DeepSpeed's rounding


class WarmupLR(Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = warmup_min_lr
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)   # DeepSpeed's floor: ln(1) would divide by zero
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def gamma(self) -> float:
        it = self.last_batch_iteration
        return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type) if it < self.warmup_num_steps else 1.0

    def lr(self) -> float:
        if self.last_batch_iteration < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return super().gamma()
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(Schedule):
    """The optimizer's lr times a ratio: warmup_min_ratio -> 1 over the warmup, then a cosine to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.base_lr = optimizer.param_groups[0]["lr"]
        if last_batch_iteration == -1:
            self._apply()

    def ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lr(self) -> float:
        return self.base_lr * self.ratio()


class OneCycle(Schedule):
    """Up from cycle_min_lr to cycle_max_lr, back down, then optional decay; beta1 (or momentum) the other way."""

    def __init__(self, optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.first = float(cycle_first_step_size)
        self.second = self.first if cycle_second_step_size is None else float(cycle_second_step_size)
        self.total = self.first + self.second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.decay_step_size = decay_step_size
        # Momentum cycles only for optimizers with betas (DeepSpeed checks optimizer.defaults the same way).
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        if last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = cycle_min_lr
                if self.cycle_momentum:
                    group["betas"] = (cycle_min_mom, 0.99)

    def scale(self) -> float:
        """0 -> 1 over the first half of the cycle, 1 -> 0 over the second (in stairs if asked)."""
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total - math.floor(1 + it / self.total)
        ratio = self.first / self.total
        scale, stairs = (x / ratio, self.first_stairs) if x <= ratio else ((x - 1) / (ratio - 1), self.second_stairs)
        if stairs > 0:
            pos = it % self.total
            pos = pos * stairs / self.first if pos <= self.first else (self.total - pos) * stairs / self.second
            scale = math.floor(pos) / stairs
        return scale

    def _decay(self, rate: float) -> float | None:
        """The post-cycle decay factor, or None where there is no decay."""
        if math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0):
            return None
        return 1 + rate * (self.last_batch_iteration - self.total + 1) / self.decay_step_size

    def lr(self) -> float:
        if self.last_batch_iteration < self.total:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale()
        decay = self._decay(self.decay_lr_rate)
        return self.min_lr if decay is None else self.min_lr / decay

    def momentum(self) -> float | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale()
        decay = self._decay(self.decay_mom_rate)
        return self.max_mom if decay is None else self.max_mom * decay


class LRRangeTest(Schedule):
    """lr = lr_range_test_min_lr x (1 + step_rate x iterations / step_size), continuous or in stairs."""

    def __init__(self, optimizer, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr, self.step_size, self.step_rate = lr_range_test_min_lr, lr_range_test_step_size, \
            lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = lr_range_test_min_lr

    def lr(self) -> float:
        interval = (self.last_batch_iteration + 1) / self.step_size
        return self.min_lr * (1 + self.step_rate * (math.floor(interval) if self.staircase else interval))


SCHEDULES: dict[str, type[Schedule]] = {
    "WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle, "LRRangeTest": LRRangeTest,
}


def build(kind: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> Schedule:
    """The schedule the config's `scheduler` section names, over `optimizer` (the config checked the keys)."""
    return SCHEDULES[kind](optimizer, **params)
