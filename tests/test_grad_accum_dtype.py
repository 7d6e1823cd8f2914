"""data_types.grad_accum_dtype: bf16 training with gradients summed in fp32 over micro-steps.

References: the bytes per parameter by hand (2 bf16 parameters + 4 fp32 gradients + 12 master and Adam at
stage 0: 18 B/param, where bf16 accumulation keeps 16), and a single process written out below that sums the
same bf16 micro-batch gradients in fp32.
"""

from __future__ import annotations

import pytest
import torch
from zero_r_workers import accum_run

import zeroedu
from zeroedu import theory
from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

from reference import LR, param_rel

pytestmark = pytest.mark.timeout(300)


def fp32_accumulation_reference(world: int = 2, accum: int = 2, steps: int = 2, global_batch: int = 8):
    """The engine's arithmetic on one process: each rank's micro-batch gradient in bf16 (of loss / accum), summed
    in fp32, divided by the ranks, summed over ranks; Adam on fp32 master weights."""
    m = TinyGPT().to(torch.bfloat16)
    params = list(dict.fromkeys(m.parameters()))
    master = [p.detach().float().clone() for p in params]
    opt = torch.optim.Adam(master, lr=LR)
    for s in range(steps):
        x, y = gpt_batch(s, global_batch)
        total = [torch.zeros_like(q) for q in master]
        for r in range(world):
            acc = [torch.zeros_like(q) for q in master]
            for micro in range(accum):
                xs, ys = shard_batch(x, y, r, world, micro, accum)
                for p in params:
                    p.grad = None
                (gpt_loss(m(xs), ys) * (1.0 / accum)).backward()
                for a, p in zip(acc, params, strict=True):
                    a.add_(p.grad)
            for t, a in zip(total, acc, strict=True):
                t.add_(a / world)
        for q, t in zip(master, total, strict=True):
            q.grad = t
        opt.step()
        with torch.no_grad():
            for p, q in zip(params, master, strict=True):
                p.copy_(q)
    names = {p: n for n, p in m.named_parameters()}
    return {names[p]: q for p, q in zip(params, master, strict=True)}


# fp32 accumulation must not train further from the fp32 reference than bf16 accumulation does. Where it only
# helps a little (stages 2-3, below) the two distances differ by about 0.02%, which is rounding, not a property:
# compare them with this stated tolerance instead of a bare <=.
NO_WORSE = 1.05


def test_fp32_accumulation_bytes_and_values():
    runs = [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", None)]
    res = {key: zeroedu.launch(accum_run, world_size=2, args=key)[0] for key in runs}
    ref = fp32_accumulation_reference()
    for stage in (0, 1, 2, 3):
        fp32, bf16 = res[(stage, "fp32")], res[(stage, None)]
        full, shard = fp32["full"], fp32["shard"]
        grads = fp32["resident"]["gradients"]
        assert grads == (4 * full if stage <= 1 else 4 * shard)                # fp32 where bf16 keeps 2 bytes
        assert bf16["resident"]["gradients"] == (2 * full if stage <= 1 else 2 * shard)
        # bytes per parameter (padding aside), as zeroedu.theory counts them: 2 + 4 + 4 + 8 = 18 at stage 0 (16
        # with bf16 accumulation), 2 + 4 + 12 / 2 = 12 at stage 1 on 2 ranks, and so on
        states = sum(fp32["resident"][k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))
        per_param = theory.model_state_bytes_per_param("bf16", grad_accum_dtype="fp32", world_size=2, stage=stage)
        assert states == per_param["total"] * full, (stage, states, per_param)
        if stage == 0:
            assert states == 18 * full
        # Adam turns rounding into weight differences. Stages 0 and 1 reduce the fp32 sums once a step: they track
        # the fp32 reference (measured here 1.2e-4 at stage 0) much closer than bf16 accumulation (5.1e-4).
        # Stages 2-3 reduce-scatter every micro-step in bf16 (the reference sums ranks in fp32), so there fp32
        # accumulation only helps a little (4.6137e-4 against 4.6146e-4 here): no worse, within NO_WORSE.
        near, far = param_rel(fp32["params"], ref), param_rel(bf16["params"], ref)
        if stage <= 1:
            assert near < 3e-4 and near < far / 2, (stage, near, far)
        else:
            assert near <= far * NO_WORSE, (stage, near, far)
