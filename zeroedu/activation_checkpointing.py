"""Activation checkpointing as `deepspeed.checkpointing`: ZeRO-R's answer to activation memory.

`checkpoint(fn, *args)` runs fn without keeping anything for backward but its inputs (the checkpoint), and runs
fn again during backward to rebuild what its backward needs (recomputation: about one more forward per step).
A transformer layer keeps sbh(34 + 5as/h) bytes (Korthikanti et al. 2022); checkpointed, it keeps its input,
2sbh (zeroedu.theory.korthikanti_layer_bytes). The config's "activation_checkpointing" section, or `configure`,
adds ZeRO-R's refinements (Rajbhandari et al. 2020, Sec. 6):

- partition_activations (P_a): under tensor parallelism every TP rank holds the same layer input. Each keeps
  only its 1/t piece of every floating-point tensor argument and the TP group all-gathers it before the
  recompute (ledger: op all_gather, kind "activations", phase backward).
- cpu_checkpointing (P_a+cpu): the kept pieces live on the host. The copy there in forward and back in
  backward are ledger entries (op "d2h" / "h2d", kind "activations"). Host bytes are not device activations:
  `stats()["host_bytes"]` counts them. On a machine without a GPU the device is the host, so the copies are
  memcpys and the tiers are categories, as with zeroedu.offload.
- contiguous_memory_optimization (C_B and M_D): the pieces go into one preallocated buffer of
  `number_checkpoints` slots instead of one allocation each, so freeing the layers' other tensors leaves no
  holes between checkpoints (notebook 11 shows why with zeroedu.allocator).
- synchronize_checkpoint_boundary: wait for the device at the start and end of every checkpoint (CUDA; a CPU
  computes synchronously, so there it only counts the boundaries).
- profile: time every checkpoint's forward and its recompute + backward (`stats()`).

As in DeepSpeed, cpu_checkpointing and contiguous_memory_optimization act on the partitioned checkpoint and so
need partition_activations; without tensor parallelism a partition is the whole tensor. The random state is
saved with each checkpoint and restored for its recompute, so dropout draws the same masks twice. Under ZeRO
stage 3 the recompute gathers each module's parameters again (zeroedu.stages.stage3 asks `recomputing()`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from zeroedu.comm import Comm, Ledger
from zeroedu.config import ActivationCheckpointingConfig, load_config
from zeroedu.memory import saved_by

KIND = "activations"   # the ledger kind (zeroedu.vocab.LEDGER_KINDS) of every byte checkpointing moves


@dataclass
class _State:
    config: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    comm: Comm | None = None          # the tensor-parallel group that shares a partitioned checkpoint
    ledger: Ledger = field(default_factory=Ledger)
    buffers: dict = field(default_factory=dict)   # (dtype, device) -> the contiguous buffer
    slot: int = 0                     # the contiguous buffer's next free slot
    live: int = 0                     # checkpoints made whose backward has not run yet
    recomputing: int = 0
    stats: dict = field(default_factory=dict)


_STATE = _State()


def _fresh_stats() -> dict:
    return {"checkpoints": 0, "recomputes": 0, "synchronized": 0, "host_bytes": 0, "host_bytes_peak": 0,
            "forward_seconds": [],
            "recompute_seconds": []}


_STATE.stats = _fresh_stats()


def configure(config=None, tp_comm: Comm | None = None, ledger: Ledger | None = None, *,
              partition_activations: bool | None = None, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> ActivationCheckpointingConfig:
    """Set how `checkpoint` works, like deepspeed.checkpointing.configure: from a config (its
    "activation_checkpointing" section) and/or the keyword overrides (DeepSpeed's names). `tp_comm` is the
    tensor-parallel group (None: no tensor parallelism, a partition is the whole tensor); `ledger` is where the
    bytes moved are recorded (the tp_comm's ledger if not given). Resets the buffers and statistics."""
    ac = load_config(config).activation_checkpointing if config is not None else ActivationCheckpointingConfig()
    raw = {k: v for k, v in {
        "partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize, "profile": profile}.items() if v is not None}
    if raw:   # validated like the config, so that a wrong combination gets the same error
        merged = {**{k: getattr(ac, k) for k in ac.__dataclass_fields__}, **raw}
        ac = load_config({"activation_checkpointing": merged}).activation_checkpointing
    _STATE.config, _STATE.comm = ac, tp_comm
    _STATE.ledger = ledger if ledger is not None else tp_comm.ledger if tp_comm is not None else Ledger()
    reset()
    return ac


def reset() -> None:
    """Forget the contiguous buffers and the statistics (DeepSpeed's checkpointing.reset)."""
    _STATE.buffers, _STATE.slot, _STATE.live, _STATE.stats = {}, 0, 0, _fresh_stats()


def is_configured() -> bool:
    return _STATE.config != ActivationCheckpointingConfig() or _STATE.comm is not None


def settings() -> ActivationCheckpointingConfig:
    return _STATE.config


def stats() -> dict:
    """Counts since configure/reset: checkpoints made, recomputes run, boundaries synchronized, host bytes of the
    checkpoints alive now and at most, and (profile) seconds of each forward and each recompute + backward."""
    return {k: list(v) if isinstance(v, list) else v for k, v in _STATE.stats.items()}


def ledger() -> Ledger:
    return _STATE.ledger


def recomputing() -> bool:
    """True while a checkpoint's function runs again in backward."""
    return _STATE.recomputing > 0


@contextmanager
def _recompute():
    _STATE.recomputing += 1
    try:
        yield
    finally:
        _STATE.recomputing -= 1


def _sync(device: torch.device) -> None:
    if _STATE.config.synchronize_checkpoint_boundary:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _STATE.stats["synchronized"] += 1


def _copy(dst: torch.Tensor, src: torch.Tensor, op: str, phase: str) -> None:
    """dst.copy_(src) between device and host, as a ledger entry."""
    wall0, t0 = time.time(), time.perf_counter()
    dst.copy_(src)
    nbytes = src.numel() * src.element_size()
    _STATE.ledger.note(op, phase, KIND, _STATE.comm.step if _STATE.comm else 0, src, group=(0,), sent_bytes=nbytes,
                       impl="memcpy", seconds=time.perf_counter() - t0, start=wall0)


def _tp() -> tuple[int, int]:
    c = _STATE.comm
    return (c.rank, c.world_size) if c is not None else (0, 1)


def _partitioned(t: torch.Tensor) -> bool:
    return _STATE.config.partition_activations and t.is_floating_point()


def _slot(dtype: torch.dtype, device: torch.device, k: int) -> torch.Tensor:
    """The next free slot of the contiguous buffer for (dtype, device), made at the first checkpoint."""
    n = _STATE.config.number_checkpoints
    buf = _STATE.buffers.get((dtype, device))
    if buf is None:   # sized by the first checkpoint: a transformer's layer inputs all have one size
        buf = _STATE.buffers[(dtype, device)] = torch.empty(n, k, dtype=dtype, device=device)
    if _STATE.slot >= n:
        raise RuntimeError(f"activation_checkpointing.number_checkpoints is {n}, but this forward makes more "
                           f"checkpoints than that: set it to the number of checkpoint() calls per forward.")
    if k > buf.shape[1]:
        raise RuntimeError(f"a checkpoint's piece has {k} elements, more than the contiguous buffer's slots "
                           f"({buf.shape[1]}, sized by the first checkpoint): contiguous_memory_optimization needs "
                           f"checkpoints of one size, such as a transformer's layer inputs.")
    _STATE.slot += 1
    # A tensor of its own over the slot's bytes, not the view buf[i]: views share their base's version counter,
    # so filling the next slot would mark this one modified and backward would refuse what autograd saved.
    slot = torch.empty(0, dtype=dtype, device=device)
    return slot.set_(buf.untyped_storage(), (_STATE.slot - 1) * buf.shape[1], (k,))


def _keep(t: torch.Tensor) -> torch.Tensor:
    """What this rank keeps of a tensor argument: its 1/t piece (padded), in the contiguous buffer and/or on
    the host as configured; the tensor itself when it is not partitioned."""
    ac = _STATE.config
    if not _partitioned(t):
        return t.detach()
    rank, tp = _tp()
    flat = t.detach().reshape(-1)
    k = -(-flat.numel() // tp)
    piece = flat[rank * k: (rank + 1) * k]
    if piece.numel() < k:     # the last ranks' pieces run past the end: pad with zeros
        piece = torch.cat([piece, piece.new_zeros(k - piece.numel())])
    device = torch.device("cpu") if ac.cpu_checkpointing else t.device
    if ac.contiguous_memory_optimization:
        dst = _slot(t.dtype, device, k)
    elif ac.cpu_checkpointing:
        dst = torch.empty(k, dtype=t.dtype, device=device)
    else:   # tp > 1: a copy with its own storage, so that the full input can be freed
        return piece.clone() if tp > 1 else piece
    if ac.cpu_checkpointing:
        _copy(dst, piece, "d2h", "forward")
        _STATE.stats["host_bytes"] += dst.numel() * dst.element_size()
        _STATE.stats["host_bytes_peak"] = max(_STATE.stats["host_bytes_peak"], _STATE.stats["host_bytes"])
    else:
        dst.copy_(piece)
    return dst


def _restore(kept: torch.Tensor, like: dict, device: torch.device) -> torch.Tensor:
    """The full tensor again from this rank's kept piece: back to the device, all-gathered over the TP group."""
    if not like["partitioned"]:
        return kept
    piece = kept
    if _STATE.config.cpu_checkpointing:
        piece = torch.empty(kept.shape, dtype=kept.dtype, device=device)
        _copy(piece, kept, "h2d", "backward")
        _STATE.stats["host_bytes"] -= kept.numel() * kept.element_size()
    _, tp = _tp()
    if tp > 1:
        full = torch.empty(tp * piece.numel(), dtype=piece.dtype, device=device)
        comm = _STATE.comm
        if comm.parent is None:
            with comm.in_phase("backward"):
                comm.all_gather(full, piece.contiguous(), kind=KIND)
        else:
            comm.all_gather(full, piece.contiguous(), kind=KIND)
        piece = full
    return piece[: like["numel"]].view(like["shape"])


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, _requires_grad, *args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        _sync(device)
        if _STATE.live == 0:
            _STATE.slot = 0       # no checkpoint is waiting for backward: the contiguous buffer is free again
        _STATE.live += 1
        _STATE.stats["checkpoints"] += 1
        t0 = time.perf_counter()
        ctx.fn, ctx.device = fn, device
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        out = fn(*args)
        ctx.args = []                    # per argument: a tensor's description, or the value itself
        device_kept, host_kept = [], []
        for a in args:
            if not isinstance(a, torch.Tensor):
                ctx.args.append(("value", a))
                continue
            kept = _keep(a)
            on_host = _STATE.config.cpu_checkpointing and _partitioned(a)
            (host_kept if on_host else device_kept).append(kept)
            ctx.args.append(("host" if on_host else "device", {
                "partitioned": _partitioned(a), "shape": a.shape, "numel": a.numel(),
                "requires_grad": a.requires_grad}))
        ctx.save_for_backward(*device_kept)    # what the activation meter sees
        ctx.host_kept = host_kept              # host memory: counted in stats()["host_bytes"]
        if _STATE.config.profile:
            _STATE.stats["forward_seconds"].append(time.perf_counter() - t0)
        _sync(device)
        return out

    @staticmethod
    def backward(ctx, *grads):
        t0 = time.perf_counter()
        _sync(ctx.device)
        device_kept, host_kept = iter(ctx.saved_tensors), iter(ctx.host_kept)
        inputs = []
        for where, a in ctx.args:
            if where == "value":
                inputs.append(a)
                continue
            full = _restore(next(host_kept if where == "host" else device_kept), a, ctx.device)
            inputs.append(full.detach().requires_grad_(a["requires_grad"]))
        cuda = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(ctx.rng)
            if cuda:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            with torch.enable_grad(), _recompute():
                out = ctx.fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _STATE.live -= 1
        _STATE.stats["recomputes"] += 1
        _sync(ctx.device)
        if _STATE.config.profile:
            _STATE.stats["recompute_seconds"].append(time.perf_counter() - t0)
        return (None, None, *(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs))


def checkpoint(fn, *args):
    """fn(*args), keeping only the (partitioned, host, contiguous: as configured) inputs for backward and
    running fn again there. fn returns a tensor or a tuple of tensors. Without grad mode it just calls fn."""
    if not torch.is_grad_enabled():
        return fn(*args)
    # autograd packs what forward saved once apply returns: the meter attributes it to fn's module here
    # The empty tensor that requires grad makes the outputs require grad even when no input does (the first
    # layer's input, a tensor-parallel layer's): fn's parameters still need their gradients.
    with saved_by(fn) if isinstance(fn, torch.nn.Module) else nullcontext():
        return _Checkpoint.apply(fn, torch.empty(0, requires_grad=True), *args)


__all__ = ["checkpoint", "configure", "is_configured", "ledger", "recomputing", "reset", "settings", "stats"]
