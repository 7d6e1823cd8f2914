"""Independent references the engine is compared with: single-process training on the global batch.

Nothing here imports the engine. The mixed-precision reference is written out by hand: a bf16/fp16 model,
an fp32 copy of the weights that Adam steps, and a cast back after every step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeroedu.models import Quirky, TinyGPT, gpt_batch, gpt_loss, quirky_batch

LR = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make(model: str, seed: int = 0) -> nn.Module:
    return TinyGPT(seed=seed) if model == "gpt" else Quirky(seed=seed)


def batch(model: str, step: int, n: int):
    return gpt_batch(step, n) if model == "gpt" else quirky_batch(step, n)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return gpt_loss(logits, y) if logits.dim() == 3 else F.cross_entropy(logits.float(), y)


def single_process(model: str = "gpt", steps: int = 4, global_batch: int = 8, precision: str = "fp32",
                   clip: float = 0.0, scale: float = 1.0):
    """Train on the whole global batch in one process. Returns (losses, {name: fp32 weights})."""
    m = make(model)
    dtype = DTYPES[precision]
    m.to(dtype)
    params = list(m.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adam(master, lr=LR)
    losses = []
    for s in range(steps):
        x, y = batch(model, s, global_batch)
        loss = loss_fn(m(x), y)
        for p in params:
            p.grad = None
        (loss * scale).backward()
        for p, q in zip(params, master, strict=True):
            q.grad = p.grad.float() / scale if p.grad is not None else torch.zeros_like(q)
        if clip:
            torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        with torch.no_grad():
            for p, q in zip(params, master, strict=True):
                p.copy_(q)
        losses.append(loss.item())
    names = [n for n, _ in m.named_parameters()]
    return losses, dict(zip(names, (q.detach() for q in master), strict=True))


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def param_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    num = sum(((a[k].float() - b[k].float()) ** 2).sum() for k in b)
    den = sum((b[k].float() ** 2).sum() for k in b)
    return float((num / den).sqrt())
