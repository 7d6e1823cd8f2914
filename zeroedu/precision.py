"""Precision: which dtype computes, fp32 master weights, and fp16's dynamic loss scale.

bf16 and fp16 runs keep the model (and so activations and gradients) in 16 bits and the optimizer's copy of
the weights in fp32, 4 bytes per parameter: the "fp32 master weights" of the ZeRO paper's K = 12
(master 4 + Adam momentum 4 + variance 4). fp32 runs have no separate master copy: the parameters are it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroedu.theory.vocab import DTYPE_NAMES

DTYPES = {precision: getattr(torch, name) for precision, name in DTYPE_NAMES.items()}


def compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


@dataclass
class LossScaler:
    """fp16 loss scaling as DeepSpeed's fp16 section configures it.

    The loss is multiplied by `scale` before backward so that small fp16 gradients do not flush to zero. A
    step whose gradients overflow (inf/nan) is skipped, with a static scale too. `loss_scale` 0 means dynamic:
    overflows first use up `hysteresis`; once it is spent the scale halves (never below `min_scale`). After
    `window` steps without overflow the next clean one doubles the scale and the hysteresis is restored; with
    `consecutive_hysteresis` every step without overflow restores it (so only overflows in a row count).
    """

    scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    dynamic: bool = False
    consecutive_hysteresis: bool = False
    _hysteresis_left: int = 2
    _clean_steps: int = 0

    @classmethod
    def from_config(cls, fp16) -> LossScaler:
        if not fp16.enabled:
            return cls()
        if not fp16.dynamic:
            return cls(scale=float(fp16.loss_scale))
        return cls(scale=float(2 ** fp16.initial_scale_power), window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, min_scale=fp16.min_loss_scale, dynamic=True,
                   consecutive_hysteresis=fp16.consecutive_hysteresis, _hysteresis_left=fp16.hysteresis)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        # DeepSpeed counts the clean steps before this one: the scale doubles on the (window + 1)-th clean step
        # after an overflow (or the start), then every `window` clean steps.
        if self._clean_steps > 0 and self._clean_steps % self.window == 0:
            self.scale *= 2
            if not self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
        self._clean_steps += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._clean_steps = int(state["clean_steps"])
