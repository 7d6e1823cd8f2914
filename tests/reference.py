"""Independent references the engine is compared with: single-process training on the global batch.

Nothing here imports the engine. The mixed-precision reference is written out by hand: a bf16/fp16 model,
an fp32 copy of the weights that Adam steps, and a cast back after every step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeroedu.models import TinyGPT, gpt_batch, gpt_loss

LR = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Quirky(nn.Module):
    """Every awkward case in one model: a tied weight, a layer used twice in one forward, a parameter that
    never gets a gradient, a buffer, and parameter counts that no world size divides."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(13, 7)
        self.twice = nn.Linear(7, 7)
        self.unused = nn.Linear(3, 5)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 7))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.shift
        x = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        return self.head(x)


def quirky_batch(step: int, batch: int):
    g = torch.Generator().manual_seed(7_919 + step)
    x = torch.randint(0, 13, (batch, 5), generator=g)
    return x, (x * 3 + 1) % 13


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
