"""How big the buffers are when the config does not say: where zeroedu's defaults differ from DeepSpeed's.

DeepSpeed's defaults are fixed element counts: `reduce_bucket_size` 5e8, `stage3_prefetch_bucket_size` 5e7,
`stage3_max_live_parameters` 1e9. Its buffers are then min(size, model), which for any model below 5e8
parameters is the whole model. At stage 2 the two reduce buffers that alternate (one fills while the other is
on the wire) then hold 2 Psi elements, 8 Psi bytes in fp32: more than stage 2 saves by sharding the gradients,
so the shortest config shows ZeRO-2 using more memory than ZeRO-1. At stage 3, a prefetch of 5e7 elements
gathers the whole model at the first module. These are the buffers of ZeRO-R's C_B (constant-size buffers, in
the ZeRO paper): kept at a fixed size so that they do not grow with the model; but a size fixed for billion-
parameter models is, for a model of a few million, the whole model. zeroedu keeps the fixed cap (5e7) for
large models and sizes the buffers to the model below it.

So when a key is left out (or null), zeroedu sizes it to the model:
- `reduce_bucket_size` at stages 0 and 1: STAGE01_BUCKET (5e7). There a bucket is a view into the flat
  gradient buffer and costs no memory of its own, and on few cores fewer, larger collectives run faster.
- `reduce_bucket_size` at stage 2: Psi / BUCKETS_PER_MODEL, at least the largest unit (the parameters one
  module owns) and at most STAGE01_BUCKET. The two buffers in flight then hold 2 Psi / BUCKETS_PER_MODEL
  elements, a fixed fraction of the model whatever its size, and a step runs about BUCKETS_PER_MODEL
  reductions, as FSDP2 does with one group per block.
- `reduce_bucket_size` at stage 3: the largest unit. A stage-3 bucket holds whole units (each is released as
  its gradients go into the bucket), so this is the smallest bucket every unit fits in: FSDP2 too reduces one
  group at a time. Stage 3 is the stage whose peak the buffers weigh on most, since its model states are the
  smallest.
- `stage3_prefetch_bucket_size`: the same Psi / BUCKETS_PER_MODEL (whatever `reduce_bucket_size` is), and
  `stage3_max_live_parameters`: twice that. Stage 3 gathers ahead what the next units need, about one bucket,
  and stops prefetching while two buckets' worth are gathered (the unit computing and the next), as FSDP2
  gathers one group ahead; not the rest of the model. (As in DeepSpeed, the prefetch size bounds what one
  module's hook starts gathering; the hooks of nested modules each start their own, and only the live limit
  bounds the sum.)

A value the config gives is used as given, as DeepSpeed does (buckets of at most that many elements, a
parameter larger than that in a bucket of its own).
"""

from __future__ import annotations

import math

import torch

STAGE01_BUCKET = 50_000_000
BUCKETS_PER_MODEL = 8


def is_leaf(m: torch.nn.Module) -> bool:
    """Is m a stage-3 leaf (zeroedu.zero.set_z3_leaf_modules): gathered whole, with everything inside it?"""
    return bool(getattr(m, "_z3_leaf", False))


def module_units(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """Each module that owns trainable parameters directly, with them; a shared parameter goes to its first module
    (stage 3's units). A leaf module (set_z3_leaf_modules) is one unit with every parameter inside it, and the
    modules inside it have none."""
    seen: set[torch.nn.Parameter] = set()
    inside: set[torch.nn.Module] = set()   # modules within a leaf
    units = []
    for m in module.modules():
        if m in inside:
            continue
        leaf = is_leaf(m) and m is not module
        if leaf:
            inside.update(sub for sub in m.modules() if sub is not m)
        mine = [p for p in m.parameters(recurse=leaf) if p.requires_grad and p not in seen]
        seen.update(mine)
        if mine:
            units.append((m, mine))
    return units


def largest_unit(module: torch.nn.Module) -> int:
    return max((sum(p.numel() for p in params) for _, params in module_units(module)), default=1)


def model_numel(module: torch.nn.Module) -> int:
    """zeroedu's buffer size for this model: Psi / BUCKETS_PER_MODEL, at least its largest unit (so that a unit fits
    in one buffer), at most STAGE01_BUCKET."""
    psi = sum(sum(p.numel() for p in params) for _, params in module_units(module))
    return max(largest_unit(module), min(math.ceil(psi / BUCKETS_PER_MODEL), STAGE01_BUCKET))


def reduce_bucket_numel(config, module: torch.nn.Module) -> int:
    """`reduce_bucket_size` as the config gives it, or zeroedu's size for this model and stage."""
    zc = config.zero_optimization
    if zc.reduce_bucket_size is not None:
        return zc.reduce_bucket_size
    if zc.stage < 2:
        return STAGE01_BUCKET
    return model_numel(module) if zc.stage == 2 else largest_unit(module)


def prefetch_numel(config, module: torch.nn.Module) -> int:
    """`stage3_prefetch_bucket_size` as the config gives it, or zeroedu's size for this model."""
    given = config.zero_optimization.stage3_prefetch_bucket_size
    return model_numel(module) if given is None else given


def max_live_numel(config, module: torch.nn.Module) -> int:
    """`stage3_max_live_parameters` as the config gives it, or two of zeroedu's buffers for this model."""
    given = config.zero_optimization.stage3_max_live_parameters
    return 2 * model_numel(module) if given is None else given
