"""Graduating to DeepSpeed: the same training script under `import zeroedu as ds` and `import deepspeed as ds`.

Notebook 14 runs `train` below on CPU ranks twice, once per library, with the same model, data and config, and
compares what each measured (a Trained per library, both in a Compared). DeepSpeed runs on CPU over gloo
(deepspeed.init_distributed(dist_backend="gloo")).

DeepSpeed's "Adam" on CPU is FusedAdam, a C++ extension that DeepSpeed compiles on its first use and caches under
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR). Measured on this course's 2-core machine with a fresh cache, the
build was still compiling after more than 5 minutes. Notebook 14 and tests/test_graduate.py therefore write
`"torch_adam": true` in the optimizer's params (with weight_decay 0: DeepSpeed then steps torch's AdamW, the same
update as Adam), a DeepSpeed key that zeroedu accepts with a note since it always runs torch's Adam.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class Batch(NamedTuple):
    """The batch sizes an engine derived from the config."""

    micro: int                 # samples per rank per micro-step (train_micro_batch_size_per_gpu)
    accumulation: int          # micro-steps per optimizer step (gradient_accumulation_steps)
    train_batch_size: int      # micro x accumulation x ranks


@dataclass
class Consolidated:
    """Rank 0's checkpoint, merged into one fp32 state dict by the library's own tool."""

    same_as_engine: bool                   # it equals the engine's fp32 master weights, bit for bit
    tensors: dict[str, torch.Tensor]       # the state dict, in fp32


@dataclass
class Trained:
    """What `train` measured on one rank under one library."""

    losses: list[float]                    # the global-batch loss of each optimizer step
    lrs: list[float]                       # the learning rate after each optimizer step
    batch: Batch
    model_states: dict[str, int]           # bytes resident after the last step, by category (zeroedu's meter)
    peak: dict[str, int]                   # the last step's peak bytes, by category
    peak_total: int
    comm: dict[str, dict[int, int]]        # {collective: {message bytes: count}} over the whole run
    files: list[str]                       # the checkpoint's files, relative to its folder
    consolidated: Consolidated | None      # rank 0 only
    optimizer: str                         # the class name of the optimizer that stepped


@dataclass
class Compared:
    """`compare`'s result on one rank: the same script under each library."""

    zeroedu: Trained
    deepspeed: Trained


def import_deepspeed():
    """DeepSpeed, ready for CPU ranks over gloo (torch.distributed already initialized by zeroedu.launch).

    On CPU, DeepSpeed compiles a shared-memory all-reduce extension the first time its comm layer starts (minutes
    on a small machine, then cached). That kernel serves inference all-reduces only; training collectives go
    through torch.distributed (gloo here). So it is marked unavailable and not built.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def library(name: str):
    """`import zeroedu as ds` or `import deepspeed as ds`, by name."""
    if name == "deepspeed":
        return import_deepspeed()
    if name != "zeroedu":
        raise ValueError(f"library must be 'zeroedu' or 'deepspeed', got {name!r}")
    return importlib.import_module("zeroedu")


def _deepspeed_owned(engine) -> dict[str, list]:
    """DeepSpeed's tensors by zeroedu's memory categories (its stage 1-2 optimizer, DeepSpeedZeroOptimizer)."""
    opt = engine.optimizer
    state = [v for s in opt.optimizer.state.values() for v in s.values() if hasattr(v, "dim")]
    ipg = getattr(opt, "ipg_buffer", None) or []
    grads = [g for g in (getattr(opt, "averaged_gradients", {}) or {}).values() for g in (g or [])]
    return {
        "parameters": list(getattr(opt, "bit16_groups_flat", [])) or [p.data for p in engine.module.parameters()],
        "gradients": grads + [p.grad for p in engine.module.parameters() if p.grad is not None],
        "master_weights": list(opt.single_partition_of_fp32_groups),
        "optimizer_state": [v for v in state if v.dim() > 0],
        "buckets": list(ipg),
        "other": [v for v in state if v.dim() == 0],
    }


def _comm_counts(name: str, engine) -> dict[str, dict[int, int]]:
    """{collective: {message bytes: count}}: zeroedu's ledger, or DeepSpeed's comms logger."""
    out: dict[str, dict[int, int]] = {}
    if name == "zeroedu":
        for e in engine.ledger:
            if e.op != "skipped_step":
                sizes = out.setdefault(e.op, {})
                sizes[e.tensor_bytes] = sizes.get(e.tensor_bytes, 0) + 1
        return out
    from deepspeed.comm import comm as ds_comm

    for op, sizes in ds_comm.comms_logger.comms_dict.items():
        out[op] = {int(size): int(vals[0]) for size, vals in sizes.items()}
    return out


def train(rank: int, world: int, name: str, config: dict, steps: int, save_dir: str) -> Trained:
    """The course's script, under `import <name> as ds`: TinyGPT on the course's synthetic batches.

    Returns the global-batch loss per step, the lr per step, model-state bytes by category (zeroedu's meter,
    on DeepSpeed's own tensors too), the collectives by message size, the peak bytes of the last step by
    category, the checkpoint's files, and the consolidated fp32 weights next to the engine's own.
    """
    import os

    import torch
    import torch.distributed as dist

    from zeroedu.memory import PeakTracker, resident
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    ds = library(name)
    engine, *_ = ds.initialize(model=TinyGPT(seed=0), config=config)
    owned = engine.owned if name == "zeroedu" else (lambda: _deepspeed_owned(engine))
    phase = {"now": "forward"}
    losses, lrs, tracker = [], [], None
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for s in range(steps):
        x, y = gpt_batch(s, micro * accum * world)
        if s == steps - 1:   # the last step's peak, measured the same way for both
            tracker = PeakTracker(owned, lambda: phase["now"])
            tracker.__enter__()
        total = torch.zeros(())
        for m in range(accum):
            xs, ys = shard_batch(x, y, rank, world, m, accum)
            phase["now"] = "forward"
            loss = gpt_loss(engine(xs), ys)
            phase["now"] = "backward"
            engine.backward(loss)
            phase["now"] = "step"
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (world * accum))
        lrs.append(engine.get_lr()[0])
    tracker.__exit__(None, None, None)
    folder = os.path.join(save_dir, name)
    engine.save_checkpoint(folder)
    dist.barrier()
    files, consolidated = _saved(name, engine, folder, rank, world)
    return Trained(losses, lrs, Batch(micro, accum, micro * accum * world), resident(owned()), dict(tracker.peak),
                   tracker.peak_total, _comm_counts(name, engine), files, consolidated,
                   type(engine.optimizer.optimizer if name == "deepspeed" else engine.optimizer).__name__)


def _saved(name: str, engine, folder: str, rank: int, world: int) -> tuple[list[str], Consolidated | None]:
    """The checkpoint's files, and on rank 0 its consolidated fp32 weights and whether they equal the engine's
    own master weights (zeroedu's consolidate, or DeepSpeed's zero_to_fp32)."""
    import os

    import torch
    import torch.distributed as dist

    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    if name == "zeroedu":
        master = engine.master_state_dict()
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        opt = engine.optimizer
        full = [torch.empty(0)] * world
        dist.all_gather_object(full, opt.single_partition_of_fp32_groups[0].detach().clone())
        master = None if rank else torch.cat(full)
    if rank == 0:
        if name == "zeroedu":
            from zeroedu.checkpoint import consolidate

            consolidated = consolidate(folder)
            same = all(torch.equal(consolidated[k], master[k]) for k in master)
        else:
            consolidated = get_fp32_state_dict_from_zero_checkpoint(folder)
            # DeepSpeed's flat partitions hold the parameters in model order, padding at the end.
            flat = torch.cat([consolidated[n].reshape(-1) for n, _ in engine.module.named_parameters()])
            same = torch.equal(flat, master[: flat.numel()])
        return files, Consolidated(same, {k: v.detach().float() for k, v in consolidated.items()})
    return files, None


def compare(rank: int, world: int, config: dict, steps: int, save_dir: str) -> Compared:
    """`train` under zeroedu, then under DeepSpeed, in the same ranks (starting ranks is the slow part)."""
    return Compared(*(train(rank, world, name, config, steps, save_dir) for name in ("zeroedu", "deepspeed")))
