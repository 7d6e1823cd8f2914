"""Closed forms for ZeRO, in bytes: model states per rank, bytes sent per step, the alpha-beta time model,
offload tiers and ZeRO++ volumes.

Pure functions of integers: no torch. The engine's tests compare what it measures to these functions byte for
byte, so each one states exactly what it counts.

Notation: psi = number of parameters, N = world size (data-parallel ranks), p = bytes of a parameter in the
compute dtype, m = bytes of its fp32 master copy (0 when the compute dtype is fp32: the parameters *are* the
master weights), o = bytes of optimizer state per parameter, K = m + o (12 for mixed-precision Adam).

Padding: zeroedu's flat buffers are cut into buckets (stages 0-2: greedy buckets of `reduce_bucket_size`
elements; stage 3: one bucket per module unit), and each bucket is padded to a multiple of N so that every
rank owns an equal piece of it. A `layout` is the list of real (unpadded) bucket sizes; `layout=None` means
one bucket of psi elements. P = layout_numel(layout, N) is then a multiple of N and P / N is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

from zeroedu.theory.vocab import (
    MODEL_STATES,
    PRECISION_BYTES,
    ZEROPP_BLOCK_SIZE,
    ZEROPP_GRAD_BITS,
    ZEROPP_SCALE_BYTES,
    ZEROPP_WEIGHT_BITS,
)

GB = 10**9          # the ZeRO paper's gigabyte (Table 1): 10^9 bytes, not 2^30
STAGES = (0, 1, 2, 3)
PRECISIONS = PRECISION_BYTES
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
TIERS = ("none", "cpu", "nvme")


def _num(x: Fraction | int) -> int | float:
    """An exact count as int when it is whole, else as float (only unpadded inputs give fractions)."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}.")


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}.")


# -- sizes --------------------------------------------------------------------------------------------------
def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `world_size` (what a bucket occupies once padded)."""
    _check_world(world_size)
    return -(-int(numel) // world_size) * world_size


def layout_numel(layout: Sequence[int] | None, world_size: int) -> int:
    """Elements of the full flat buffer: every bucket of `layout` padded to a multiple of N, summed."""
    if layout is None:
        raise ValueError("layout_numel needs a list of bucket sizes; pass [psi] for one bucket.")
    return sum(padded_numel(n, world_size) for n in layout)


def _layout(psi: int, layout: Sequence[int] | None) -> list[int]:
    if layout is None:
        return [int(psi)]
    layout = [int(n) for n in layout]
    if sum(layout) != int(psi):
        raise ValueError(f"layout sums to {sum(layout)} elements but psi is {psi}: pass the real (unpadded) "
                         f"bucket sizes of the model, or layout=None for one bucket.")
    return layout


def param_bytes(precision: str) -> int:
    """Bytes of one parameter (and of one gradient) in the compute dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}.")
    return PRECISIONS[precision]


def master_bytes(precision: str) -> int:
    """Bytes of the fp32 master copy of one parameter: 0 for fp32 (the parameters are the masters), else 4."""
    return 0 if param_bytes(precision) == 4 else 4


def optimizer_state_bytes(optimizer: str = "adam", momentum: float = 0.0) -> int:
    """Bytes of optimizer state per parameter: Adam/AdamW keep two fp32 moments (8); SGD a momentum buffer (4)
    only if momentum > 0."""
    name = optimizer.lower()
    if name in {"adam", "adamw"}:
        return 8
    if name == "sgd":
        return 4 if momentum > 0 else 0
    raise ValueError(f"optimizer must be 'adam', 'adamw' or 'sgd', got {optimizer!r}.")


def optimizer_K(precision: str = "bf16", optimizer: str = "adam", momentum: float = 0.0) -> int:
    """The paper's K: optimizer bytes per parameter = master copy + state (12 for mixed-precision Adam)."""
    return master_bytes(precision) + optimizer_state_bytes(optimizer, momentum)


# -- model states -------------------------------------------------------------------------------------------
def model_state_bytes(psi: int, world_size: int, stage: int, precision: str = "bf16", optimizer: str = "adam",
                      momentum: float = 0.0, layout: Sequence[int] | None = None) -> dict[str, int]:
    """Bytes per rank of each model state, with zeroedu's padding.

    Stage 0 keeps everything whole; stage 1 shards master weights and optimizer state (P_os); stage 2 also the
    gradients (P_os+g); stage 3 also the parameters (P_os+g+p). A sharded state holds P / N elements.
    """
    _check_stage(stage)
    _check_world(world_size)
    n = world_size
    full = layout_numel(_layout(psi, layout), n)
    shard = full // n
    p, m, o = param_bytes(precision), master_bytes(precision), optimizer_state_bytes(optimizer, momentum)
    out = {
        "parameters": p * (shard if stage >= 3 else full),
        "gradients": p * (shard if stage >= 2 else full),
        "master_weights": m * (shard if stage >= 1 else full),
        "optimizer_state": o * (shard if stage >= 1 else full),
    }
    out["total"] = sum(out.values())
    return out


def model_state_bytes_paper(psi: float, world_size: int, stage: int, K: float = 12) -> float:
    """The ZeRO paper's model-state bytes per rank (Rajbhandari et al. 2020, Sec. 5), a float:
    2 psi of fp16 parameters + 2 psi of fp16 gradients + K psi of optimizer states, no padding:
    stage 0 (4 + K) psi, stage 1 4 psi + K psi / N, stage 2 2 psi + (2 + K) psi / N, stage 3 (4 + K) psi / N.

    7.5B parameters on 64 GPUs give 120, 31.4, 16.6 and 1.9 GB for stages 0-3 (the paper's Figure 1); its Table 1
    sweeps the same formulas over N and model sizes (stage 3 at N = 64 prints there as 1.88 GB)."""
    return model_state_bytes_paper_parts(psi, world_size, stage, K)["total"]


def model_state_bytes_paper_parts(psi: float, world_size: int, stage: int, K: float = 12) -> dict[str, float]:
    """model_state_bytes_paper by the paper's three parts: "parameters", "gradients", "optimizer_states"
    (K psi: master weights and optimizer state together), and "total"."""
    _check_stage(stage)
    _check_world(world_size)
    n = world_size
    out = {
        "parameters": 2.0 * psi / (n if stage >= 3 else 1),
        "gradients": 2.0 * psi / (n if stage >= 2 else 1),
        "optimizer_states": K * psi / (n if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


# -- communication ------------------------------------------------------------------------------------------
def ring_steps(op: str, world_size: int) -> int:
    """Messages each rank sends, one after another, in the ring algorithm: N-1 per pass, two passes for
    all-reduce (a reduce-scatter, then an all-gather). all_to_all is counted as N-1 point-to-point sends."""
    _check_world(world_size)
    if op not in RING_OPS:
        raise ValueError(f"op must be one of {RING_OPS}, got {op!r}.")
    return (2 if op == "all_reduce" else 1) * (world_size - 1)


def ring_sent_bytes(op: str, nbytes: int, world_size: int) -> int | float:
    """Bytes ONE rank sends for a collective on a tensor of `nbytes` bytes (the full tensor: the all-reduced
    tensor, the reduce-scatter input, the all-gather output), under ring algorithms:
    all-reduce 2(N-1)/N S, reduce-scatter and all-gather (N-1)/N S (all_to_all too), 0 for N = 1.
    An int when S is a multiple of N (always so for zeroedu's padded buckets)."""
    steps = ring_steps(op, world_size)
    return _num(Fraction(steps * int(nbytes), world_size))


def _units(layout: list[int], named: Iterable[int] | None, kind: str = "persistent") -> tuple[list[int], list[int]]:
    """Split stage 3 units into (the rest, those `named` by size)."""
    rest, kept = list(layout), []
    for n in named or ():
        if int(n) not in rest:
            raise ValueError(f"{kind} unit of {n} elements is not in the layout {layout}: {kind} units "
                             f"must be listed (by size) among the layout's units.")
        rest.remove(int(n))
        kept.append(int(n))
    return rest, kept


def comm_bytes_per_step(psi: int, world_size: int, stage: int, precision: str = "bf16", grad_accum: int = 1,
                        layout: Sequence[int] | None = None,
                        persistent: Sequence[int] | None = None,
                        reused: Sequence[int] | None = None) -> dict[str, int | float]:
    """Bytes each rank SENDS in one optimizer step of `grad_accum` micro-steps, keyed "phase/op", plus "total".

    Collectives run in the compute dtype (p bytes an element) on padded buckets, one collective per bucket:
    - stage 0: "backward/all_reduce" of the gradients, once a step (at the last micro-step);
    - stage 1: "backward/reduce_scatter" once a step, then "step/all_gather" of the updated parameters;
    - stage 2: "backward/reduce_scatter" every micro-step (the full gradient is not kept), "step/all_gather";
    - stage 3: every micro-step, "forward/all_gather" and "backward/all_gather" of each non-persistent unit and
      "backward/reduce_scatter" of every unit; `persistent` units (sizes, each also in `layout`) stay gathered
      and are all-gathered once a step in "step/all_gather"; `reused` units (sizes, see `reused_units`) stay
      gathered from their forward to their backward, so "backward/all_gather" leaves them out.
    Scalars (the global gradient norm, the fp16 overflow flag) are not included.
    """
    _check_stage(stage)
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}.")
    n, p = world_size, param_bytes(precision)
    buckets = _layout(psi, layout)
    if (persistent or reused) and stage != 3:
        raise ValueError("persistent and reused units exist only at stage 3; pass None for stages 0-2.")

    def sent(op: str, sizes: list[int]) -> Fraction:
        return sum((Fraction(ring_sent_bytes(op, p * padded_numel(k, n), n)) for k in sizes), Fraction(0))

    out: dict[str, Fraction] = {}
    if stage == 0:
        out["backward/all_reduce"] = sent("all_reduce", buckets)
    elif stage in (1, 2):
        out["backward/reduce_scatter"] = sent("reduce_scatter", buckets) * (grad_accum if stage == 2 else 1)
        out["step/all_gather"] = sent("all_gather", buckets)
    else:
        gathered, kept = _units(buckets, persistent)
        out["forward/all_gather"] = sent("all_gather", gathered) * grad_accum
        again, _ = _units(gathered, reused, "reused")
        out["backward/all_gather"] = sent("all_gather", again) * grad_accum
        out["backward/reduce_scatter"] = sent("reduce_scatter", buckets) * grad_accum
        if kept:
            out["step/all_gather"] = sent("all_gather", kept)
    result = {k: _num(v) for k, v in out.items()}
    result["total"] = _num(sum(out.values(), Fraction(0)))
    return result


def reused_units(forward_units: Sequence[int], max_reuse_distance: int, persistence_threshold: int = 0) -> list[int]:
    """Stage-3 units (sizes in elements, in the order a chain of modules uses them in forward, each once) that
    `stage3_max_reuse_distance` keeps gathered from forward to backward. Backward runs the chain in reverse, so
    between unit j's forward and its backward every later unit is used twice; j stays gathered when those uses
    come to fewer than `max_reuse_distance` elements. Units under `persistence_threshold` are never released,
    so they are not in the list (they still count in the distance)."""
    kept, after = [], 0
    for n in reversed(forward_units):
        if 2 * after < max_reuse_distance and n >= persistence_threshold:
            kept.append(int(n))
        after += int(n)
    return kept[::-1]


def comm_volume_paper(stage: int) -> int:
    """Bytes each rank moves per step in the ZeRO paper's units of psi elements (Sec. 7): 2, 2, 2, 3.

    A ring all-reduce *is* a reduce-scatter followed by an all-gather: after the reduce-scatter pass every rank
    holds the sum of one 1/N piece, and the all-gather pass hands those sums round. Each pass sends
    (N-1)/N of the tensor, about psi elements, so data parallelism moves 2 psi. Stages 1 and 2 run the two
    halves separately (reduce-scatter the gradients, update the own piece, all-gather the parameters): still
    2 psi. Stage 3 has no full parameters to start from, so it all-gathers them in the forward and again in
    the backward, plus the gradient reduce-scatter: 3 psi, 1.5x data parallelism.
    """
    _check_stage(stage)
    return 3 if stage == 3 else 2


# -- the alpha-beta model -----------------------------------------------------------------------------------
def collective_time(op: str, nbytes: int, world_size: int, alpha_s: float, beta_bytes_per_s: float) -> float:
    """Seconds for one ring collective on S = `nbytes` bytes: each of its ring steps pays a latency alpha, and the
    bytes a rank sends cross a link of bandwidth beta: steps(op, N) * alpha + ring_sent_bytes / beta."""
    if beta_bytes_per_s <= 0 or alpha_s < 0:
        raise ValueError(f"need alpha >= 0 and beta > 0, got alpha={alpha_s}, beta={beta_bytes_per_s}.")
    return ring_steps(op, world_size) * alpha_s + float(ring_sent_bytes(op, nbytes, world_size)) / beta_bytes_per_s


def fit_alpha_beta(samples: Iterable[tuple[str, int, int, float]]) -> tuple[float, float]:
    """Fit (alpha seconds, beta bytes/s) of `collective_time` to measured (op, nbytes, world_size, seconds).

    Least squares on the *relative* error, so that small messages (which carry the latency) count as much as
    large ones (which carry the bandwidth). Samples at N = 1 carry no information and are dropped. If the best
    alpha is negative (noise on latency-free data), alpha is set to 0 and beta refit alone.
    """
    import numpy as np

    rows, times = [], []
    for op, nbytes, world, seconds in samples:
        if seconds <= 0:
            raise ValueError(f"a sample took {seconds} s: times must be positive; drop it or measure again.")
        if world > 1:
            rows.append((ring_steps(op, world), float(ring_sent_bytes(op, nbytes, world))))
            times.append(float(seconds))
    if len(rows) < 2:
        raise ValueError("fit_alpha_beta needs at least two samples at world_size >= 2; measure more sizes.")
    a = np.array(rows) / np.array(times)[:, None]     # divide each equation by its own time: relative error
    if np.linalg.matrix_rank(a) < 2:
        raise ValueError("the samples cannot separate latency from bandwidth: measure tensors of several sizes.")
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    if alpha < 0:
        alpha, inv_beta = 0.0, float(a[:, 1].sum() / (a[:, 1] ** 2).sum())
    if inv_beta <= 0:
        raise ValueError("times do not grow with bytes in these samples: measure larger tensors.")
    return float(alpha), float(1.0 / inv_beta)


# -- offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) -------------------------
def _check_offload(stage: int, offload_optimizer: str, offload_param: str) -> None:
    for name, tier in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if tier not in TIERS:
            raise ValueError(f"{name} must be one of {TIERS}, got {tier!r}.")
    if offload_optimizer != "none" and stage < 1:
        raise ValueError("optimizer offload needs stage 1, 2 or 3 (the optimizer state must be partitioned): "
                         "raise the stage or set offload_optimizer='none'.")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"parameter offload works only at stage 3 (only stage 3 partitions parameters); "
                         f"got stage {stage}: use stage 3 or offload_param='none'.")


def offload_bytes(psi: int, world_size: int, stage: int, precision: str = "bf16", offload_optimizer: str = "none",
                  offload_param: str = "none", layout: Sequence[int] | None = None, optimizer: str = "adam",
                  momentum: float = 0.0, host_grad_bytes: int = 4,
                  separate_fp32_master: bool = False) -> dict[str, dict[str, int]]:
    """Model-state bytes per rank on each tier: {"device": {...}, "host": {...}, "nvme": {...}}, each with the
    four model-state categories and "total".

    Assumptions (what ZeRO-Offload and ZeRO-Infinity do, reduced to bytes):
    - Optimizer offload runs the optimizer where its state lives. The rank's fp32 master shard (4 P/N) and the
      optimizer state (o P/N) leave the device, and the reduced gradient shard lives on the host in fp32
      (4 P/N), where the CPU optimizer reads it (DeepSpeed's CPU Adam takes fp32 gradients; an implementation
      that keeps them in the compute dtype passes host_grad_bytes=param_bytes(precision)).
    - With "nvme" the master shard and the state live on NVMe; the gradient shard stays in host memory. The
      host's staging buffers for NVMe reads and writes are not model states and are not counted.
    - The master copy exists on the optimizer's tier even for fp32 compute (the device's parameters are out
      of the CPU's reach), except when the fp32 parameter shard itself lives on that same tier (fp32 with
      parameter offload to it): then it is the master. `separate_fp32_master=True` drops that exception and
      also keeps a 4 P/N fp32 master on the device for fp32 with parameter offload alone: a separate master
      whenever parameters or optimizer leave the device (what DeepSpeed and zeroedu.offload do).
    - On the device, gradients: stage 1 still accumulates full gradients there (p P, reduced only at the
      boundary); stages 2 and 3 keep none (each reduced bucket goes straight to the host; the bucket buffers
      are not model states).
    - Parameter offload (stage 3 only) moves the rank's parameter shard (p P/N) to the host or to NVMe; the
      device holds parameters only while they are gathered (not counted here).
    """
    _check_offload(stage, offload_optimizer, offload_param)
    tiers = {t: dict.fromkeys(MODEL_STATES, 0) for t in ("device", "host", "nvme")}
    tiers["device"].update({k: v for k, v in model_state_bytes(psi, world_size, stage, precision, optimizer,
                                                               momentum, layout).items() if k != "total"})
    shard = layout_numel(_layout(psi, layout), world_size) // world_size
    p, o = param_bytes(precision), optimizer_state_bytes(optimizer, momentum)
    tier_of = {"cpu": "host", "nvme": "nvme"}
    if offload_param != "none":
        tiers["device"]["parameters"] = 0
        tiers[tier_of[offload_param]]["parameters"] = p * shard
        if separate_fp32_master and p == 4 and offload_optimizer == "none":
            tiers["device"]["master_weights"] = 4 * shard
    if offload_optimizer != "none":
        dev = tiers["device"]
        dev["master_weights"] = dev["optimizer_state"] = 0
        if stage >= 2:
            dev["gradients"] = 0
        tiers["host"]["gradients"] = host_grad_bytes * shard
        home = tier_of[offload_optimizer]
        params_are_master = p == 4 and offload_param == offload_optimizer and not separate_fp32_master
        tiers[home]["master_weights"] = 0 if params_are_master else 4 * shard
        tiers[home]["optimizer_state"] = o * shard
    for t in tiers.values():
        t["total"] = sum(t[k] for k in MODEL_STATES)
    return tiers


def offload_transfer_bytes_per_step(psi: int, world_size: int, stage: int, precision: str = "bf16",
                                    offload_optimizer: str = "cpu", offload_param: str = "none",
                                    grad_accum: int = 1, layout: Sequence[int] | None = None,
                                    optimizer: str = "adam", momentum: float = 0.0,
                                    separate_fp32_master: bool = False, hpz: bool = False) -> dict[str, int]:
    """Bytes one rank moves between tiers in one optimizer step, keyed "source_to_destination/what", plus
    "host_device" (PCIe total), "nvme" (NVMe total) and "total". Shards are P/N elements.

    Assumptions:
    - Optimizer offload: the reduced gradient shard goes device->host in the compute dtype (p P/N), once a
      step at stage 1 (reduced at the boundary) and every micro-step at stages 2-3 (reduced every micro-step,
      accumulated on the host). After the step the updated parameter shard comes back host->device in
      the compute dtype (p P/N) -- unless the parameters themselves live off the device.
    - Parameter offload (stage 3): before each of its all-gathers a unit's shard is copied host->device, so
      2 p P/N per micro-step (forward and backward); with `hpz` (ZeRO++'s secondary copy on the device) the
      backward gathers read that copy and only the forward's p P/N crosses. With the optimizer on the device
      the updated shard goes device->host once a step. Persistent (small, never released) units are ignored.
    - NVMe: the optimizer reads and writes its master shard and state once a step ((m + o) P/N each way,
      with m = 4 unless fp32 parameters on NVMe are the masters and not `separate_fp32_master`); NVMe
      parameters are read into the host before every gather (2 p P/N per micro-step) and written back once a
      step (p P/N).
    """
    _check_offload(stage, offload_optimizer, offload_param)
    shard = layout_numel(_layout(psi, layout), world_size) // world_size
    p, o = param_bytes(precision), optimizer_state_bytes(optimizer, momentum)
    fetches = (1 if hpz else 2) * grad_accum * p * shard
    out: dict[str, int] = {}
    if offload_optimizer != "none":
        out["device_to_host/gradients"] = p * shard * (grad_accum if stage >= 2 else 1)
        if offload_param == "none":
            out["host_to_device/parameters"] = p * shard
    if offload_param != "none":
        out["host_to_device/parameters"] = fetches
        if offload_optimizer == "none":
            out["device_to_host/parameters"] = p * shard
    if offload_optimizer == "nvme":
        m = 0 if (p == 4 and offload_param == "nvme" and not separate_fp32_master) else 4
        out["nvme_to_host/optimizer"] = out["host_to_nvme/optimizer"] = (m + o) * shard
    if offload_param == "nvme":
        out["nvme_to_host/parameters"] = fetches
        out["host_to_nvme/parameters"] = p * shard
    out["host_device"] = sum(v for k, v in out.items() if "device" in k)
    out["nvme"] = sum(v for k, v in out.items() if "nvme" in k)
    out["total"] = out["host_device"] + out["nvme"]
    return out


def offload_nvme_buffer_bytes(layout: Sequence[int], world_size: int, precision: str = "bf16",
                              offload_optimizer: str = "nvme", offload_param: str = "none",
                              optimizer_buffer_count: int = 4, param_buffer_count: int = 5, optimizer: str = "adam",
                              momentum: float = 0.0) -> dict[str, int]:
    """Host bytes per rank of the buffers NVMe offload reads and writes through, which offload_bytes leaves out.

    NVMe is read and written one sub-group at a time: here one bucket's piece (stage 3: one unit's piece), so the
    largest piece m = max over `layout` of padded size / N elements sets the size of every buffer:
    - offload_optimizer "nvme": `optimizer_buffer_count` sub-groups in flight, each its fp32 master and optimizer
      state: count x (4 + o) x m ("master_weights" and "optimizer_state");
    - offload_param "nvme": `param_buffer_count` pieces in the compute dtype: count x p x m ("parameters").
    Neither grows with Psi for a fixed bucket size: what grows is the files on NVMe.
    """
    _check_world(world_size)
    m = max(padded_numel(k, world_size) for k in layout) // world_size
    o = optimizer_state_bytes(optimizer, momentum)
    out = {"parameters": 0, "master_weights": 0, "optimizer_state": 0}
    if offload_optimizer == "nvme":
        out["master_weights"] = optimizer_buffer_count * 4 * m
        out["optimizer_state"] = optimizer_buffer_count * o * m
    if offload_param == "nvme":
        out["parameters"] = param_buffer_count * param_bytes(precision) * m
    out["total"] = sum(out.values())
    return out


# -- ZeRO++ (Wang et al. 2023) ------------------------------------------------------------------------------
# The quantizer's defaults (ZEROPP_* above) live in zeroedu.vocab, shared with zeroedu.zeropp: a caller that
# changes one there passes the same value to zeropp_comm_bytes.


def quantized_bytes(numel: int, bits: int, block_size: int, scale_bytes: int = ZEROPP_SCALE_BYTES) -> int:
    """Bytes of `numel` values quantized to `bits` bits in blocks of `block_size` values, each block carrying
    one scale of `scale_bytes` (symmetric quantization: no zero point; pass scale_bytes=8 for scale + offset).
    Values are packed: ceil(numel * bits / 8) bytes, plus ceil(numel / block_size) scales."""
    return -(-numel * bits // 8) + -(-numel // block_size) * scale_bytes


def zeropp_comm_bytes(psi: int, world_size: int, node_size: int, qwz: bool = False, hpz: bool = False,
                      qgz: bool = False, precision: str = "fp16", weight_bits: int = ZEROPP_WEIGHT_BITS,
                      grad_bits: int = ZEROPP_GRAD_BITS, block_size: int = ZEROPP_BLOCK_SIZE,
                      scale_bytes: int = ZEROPP_SCALE_BYTES, grad_accum: int = 1,
                      layout: Sequence[int] | None = None, persistent: Sequence[int] | None = None,
                      grad_block_size: int | None = None) -> dict:
    """Bytes per rank per optimizer step of ZeRO stage 3, with or without each ZeRO++ technique, split into
    bytes sent to a rank on the same node ("intra_node") and on another node ("cross_node").

    Ranks fill nodes in order: node k holds ranks k*g .. k*g+g-1 (g = node_size, M = N / g nodes). Per unit
    (bucket of `layout`, padded to a multiple of N) and micro-step:
    - forward all-gather, a flat ring over all N ranks. Every ring link carries the same bytes and M of its
      N links cross a node (none if M = 1), so on average 1/g of what a rank sends crosses a node. (Per node
      this is the ring volume itself: what leaves a node equals what one rank sends.) With qwZ each rank's
      piece travels as `weight_bits` integers plus one `scale_bytes` scale per `block_size` values of its
      piece (see quantized_bytes), instead of p-byte values.
    - backward all-gather: the same flat ring (quantized too under qwZ), or with hpZ a ring inside the node
      over the secondary partition (each rank keeps 1/g of the unit in the compute dtype, filled from the
      forward gather): (g-1)/g of the unit, all intra-node, never quantized. The secondary copy costs
      p P / g bytes per rank ("hpz_secondary_bytes").
    - gradients: a flat ring reduce-scatter in the compute dtype, or with qgZ a two-hop all-to-all of
      `grad_bits` quantized gradients (blocks of `grad_block_size`, default `block_size`): inside the node each
      rank sends g-1 of its g slices of P/g (quantized per slice), the node reduces, and then each rank sends
      M-1 of the M pieces (P/N each, quantized per piece) of its node-reduced slice to its peers (same local
      rank) on the other nodes.
    `persistent` units (sizes, each also in `layout`; stage3_param_persistence_threshold) are never gathered
    in forward or backward and need no secondary copy: they are all-gathered once per optimizer step after the
    update, a flat ring in the compute dtype ("step/all_gather", not quantized: DeepSpeed does not quantize it
    either). Their gradients are reduced like every other unit's.
    "collectives" lists each collective with its group size, "steps" (messages a rank sends one after another
    for ONE unit, over the step's micro-steps), "algorithm" and bytes (all units); "total" = intra + cross;
    "cross_node_per_node" = g x cross_node, the bytes one node's ranks send to other nodes per step.
    Counts are averages over ranks and may be fractional when the flat ring splits unevenly.
    """
    n, g = world_size, node_size
    grad_block = block_size if grad_block_size is None else grad_block_size
    _check_zeropp(n, g, grad_accum, weight_bits, grad_bits, block_size, grad_block)
    nodes = n // g
    p = param_bytes(precision)
    every = _layout(psi, layout)
    gathered, kept = _units(every, persistent)
    units = [padded_numel(k, n) for k in gathered]          # gathered in forward and backward
    all_units = [padded_numel(k, n) for k in every]          # reduced
    cross_share = Fraction(nodes, n) if nodes > 1 else Fraction(0)

    def weights(name: str) -> dict:
        if qwz:
            piece = sum(quantized_bytes(u // n, weight_bits, block_size, scale_bytes) for u in units)
        else:
            piece = sum(p * (u // n) for u in units)
        return _flat_ring(name, n, piece, grad_accum, cross_share)

    found = [weights("forward/all_gather"),
             _node_ring_gather(units, g, p, grad_accum) if hpz else weights("backward/all_gather")]
    if qgz:
        found.append(_two_hop_all_to_all(all_units, n, g, grad_bits, grad_block, scale_bytes, grad_accum))
    else:
        found.append(_flat_ring("backward/reduce_scatter", n, sum(p * (u // n) for u in all_units), grad_accum,
                                cross_share))
    if kept:
        found.append(_flat_ring("step/all_gather", n, sum(p * (padded_numel(k, n) // n) for k in kept), 1,
                                cross_share))
    intra = sum((c["intra_node"] for c in found), Fraction(0))
    cross = sum((c["cross_node"] for c in found), Fraction(0))
    for c in found:
        c["intra_node"], c["cross_node"] = _num(c["intra_node"]), _num(c["cross_node"])
    return {"intra_node": _num(intra), "cross_node": _num(cross), "total": _num(intra + cross),
            "cross_node_per_node": _num(cross * g),
            "collectives": found, "hpz_secondary_bytes": p * sum(units) // g if hpz else 0}


def _check_zeropp(n: int, g: int, grad_accum: int, weight_bits: int, grad_bits: int, block_size: int,
                  grad_block: int) -> None:
    _check_world(n)
    if g < 1 or n % g:
        raise ValueError(f"world_size ({n}) must be a whole number of nodes of node_size ({g}) ranks.")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}.")
    for name, bits in (("weight_bits", weight_bits), ("grad_bits", grad_bits)):
        if bits not in (4, 8):
            raise ValueError(f"{name} must be 4 or 8, got {bits!r}.")
    if block_size < 1 or grad_block < 1:
        raise ValueError(f"block sizes must be >= 1, got block_size={block_size}, grad_block_size={grad_block}.")


def _flat_ring(name: str, n: int, piece_bytes: int, times: int, cross_share: Fraction) -> dict:
    """A ring over all N ranks: N-1 pieces a call, `cross_share` of them to another node on average."""
    sent = Fraction((n - 1) * piece_bytes) * times
    return {"name": name, "group_size": n, "steps": (n - 1) * times, "algorithm": "ring",
            "intra_node": sent * (1 - cross_share), "cross_node": sent * cross_share}


def _node_ring_gather(units: list[int], g: int, p: int, grad_accum: int) -> dict:
    """hpZ's backward all-gather: a ring inside the node over the secondary partition, never quantized."""
    sent = Fraction(sum((g - 1) * p * (u // g) for u in units) * grad_accum)
    return {"name": "backward/all_gather", "group_size": g, "steps": (g - 1) * grad_accum,
            "algorithm": "node_ring", "intra_node": sent, "cross_node": Fraction(0)}


def _two_hop_all_to_all(all_units: list[int], n: int, g: int, grad_bits: int, grad_block: int, scale_bytes: int,
                        grad_accum: int) -> dict:
    """qgZ: g-1 quantized slices of P/g inside the node, then M-1 quantized pieces of P/N to the other nodes."""
    nodes = n // g
    intra = sum((g - 1) * quantized_bytes(u // g, grad_bits, grad_block, scale_bytes) for u in all_units)
    cross = sum((nodes - 1) * quantized_bytes(u // n, grad_bits, grad_block, scale_bytes) for u in all_units)
    return {"name": "backward/all_to_all", "group_size": n, "steps": (g - 1 + nodes - 1) * grad_accum,
            "algorithm": "two_hop_all_to_all", "intra_node": Fraction(intra * grad_accum),
            "cross_node": Fraction(cross * grad_accum)}


def zeropp_volume_paper(qwz: bool = False, hpz: bool = False, qgz: bool = False) -> float:
    """Cross-node volume per step in the ZeRO++ paper's units (psi fp16 elements, i.e. 2 psi bytes, large N,
    scales ignored): forward all-gather 1 (0.5 with int8 qwZ), backward all-gather 1 (0.5 with qwZ, 0 with hpZ),
    gradient reduce-scatter 1 (0.25 with int4 qgZ). Stage 3 is 3; all three give the headline 0.75."""
    gather = 0.5 if qwz else 1.0
    return gather + (0.0 if hpz else gather) + (0.25 if qgz else 1.0)


def zeropp_cross_node_ratio(psi: int, world_size: int, node_size: int, **kw) -> float:
    """zeropp_comm_bytes's cross-node bytes leaving one node per step (g x the per-rank average), in units of
    2 psi bytes: comparable to zeropp_volume_paper, which it approaches as N grows."""
    return float(zeropp_comm_bytes(psi, world_size, node_size, **kw)["cross_node_per_node"]) / (2 * psi)


# -- activations (ZeRO-R) ---------------------------------------------------------------------------------
# s = sequence length, b = micro-batch, h = hidden size, a = attention heads, L = layers.
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, recompute: str = "none",
                            flash_attention: bool = False) -> int:
    """Activation bytes one transformer layer keeps for backward, Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", Sec. 4.1, no tensor or sequence parallelism): 16-bit
    activations with 1-byte dropout masks.

    - recompute="none": sbh(34 + 5as/h) = 34sbh + 5as^2b. The 5as^2b are the attention scores, their softmax
      and its dropout mask and output: what a fused (flash-style) attention never stores, leaving 34sbh.
    - recompute="full": only the layer's input is checkpointed, 2sbh; its 34sbh (+ 5as^2b) come back during
      its own backward, one layer at a time (`activation_bytes` counts that layer).
    """
    if recompute == "full":
        return 2 * s * b * h
    if recompute != "none":
        raise ValueError(f"recompute must be 'none' or 'full', got {recompute!r}.")
    return 34 * s * b * h + (0 if flash_attention else 5 * a * s * s * b)


def activation_bytes(s: int, b: int, h: int, a: int, layers: int, recompute: str = "none",
                     flash_attention: bool = False) -> int:
    """Activation bytes of a model of `layers` Korthikanti layers at the peak of backward (16-bit).

    Without recomputation all layers' activations are alive when backward starts. With full recomputation the
    L checkpoints (2sbh each) are alive, plus one layer's recomputed activations during its backward."""
    if recompute == "full":
        return layers * korthikanti_layer_bytes(s, b, h, a, "full") + korthikanti_layer_bytes(
            s, b, h, a, "none", flash_attention)
    return layers * korthikanti_layer_bytes(s, b, h, a, recompute, flash_attention)


def tinygpt_layer_terms(s: int, b: int, h: int, a: int, precision: str = "fp32",
                        fused_attention: bool = False) -> dict[str, int]:
    """What autograd saves in one zeroedu.models.Block on the CPU, tensor by tensor, in bytes.

    The same bookkeeping as Korthikanti's, for our layer: no dropout (so no masks, and the softmax output is the
    tensor attention multiplies V with), GELU, and the CPU kernels' choices: LayerNorm keeps its mean and rstd
    (b s values each) in the compute dtype, the explicit attention keeps a boolean causal mask (s^2 bytes), and
    the fused one (scaled_dot_product_attention) keeps q, k, v, its output (which the projection reads as a view)
    and an fp32 logsumexp (b a s): p(16sbh + 4bs) + 4abs, where the explicit one keeps p(16sbh + 4bs + as^2b) + s^2.
    """
    p = param_bytes(precision)
    sbh = s * b * h
    terms = {
        "ln1 input": p * sbh, "ln1 mean+rstd": 2 * p * b * s, "qkv input": p * sbh,
    }
    if fused_attention:   # its output is laid out (b, s, a, h/a): the proj input is a view of it, not a copy
        terms |= {"q, k, v": 3 * p * sbh, "logsumexp (fp32)": 4 * b * a * s, "attention output = proj input": p * sbh}
    else:
        terms |= {"q, k (contiguous copies)": 2 * p * sbh, "causal mask (bool)": s * s,
                  "softmax output": p * a * s * s * b, "v (contiguous copy)": p * sbh, "proj input": p * sbh}
    terms |= {
        "ln2 input": p * sbh, "ln2 mean+rstd": 2 * p * b * s, "fc input": p * sbh,
        "gelu input": 4 * p * sbh, "out input": 4 * p * sbh,
    }
    return terms


def tinygpt_layer_bytes(s: int, b: int, h: int, a: int, precision: str = "fp32", fused_attention: bool = False,
                        checkpointed: bool = False) -> int:
    """Bytes one TinyGPT block keeps for backward: the sum of tinygpt_layer_terms. In 16-bit that is
    32sbh + 2as^2b + 8bs + s^2 (Korthikanti's 34sbh + 5as^2b less the dropout masks and outputs, plus the
    LayerNorm statistics and the causal mask). Checkpointed: only the block's input, p x sbh (2sbh in 16-bit)."""
    if checkpointed:
        return param_bytes(precision) * s * b * h
    return sum(tinygpt_layer_terms(s, b, h, a, precision, fused_attention).values())


__all__ = [
    "GB", "MODEL_STATES", "activation_bytes", "korthikanti_layer_bytes", "tinygpt_layer_bytes",
    "tinygpt_layer_terms", "PRECISIONS", "RING_OPS", "STAGES", "TIERS",
    "ZEROPP_BLOCK_SIZE", "ZEROPP_GRAD_BITS", "ZEROPP_SCALE_BYTES", "ZEROPP_WEIGHT_BITS",
    "collective_time", "comm_bytes_per_step", "comm_volume_paper", "fit_alpha_beta", "layout_numel",
    "master_bytes", "model_state_bytes", "model_state_bytes_paper", "model_state_bytes_paper_parts", "offload_bytes",
    "offload_nvme_buffer_bytes", "offload_transfer_bytes_per_step", "optimizer_K", "optimizer_state_bytes",
    "padded_numel", "param_bytes",
    "quantized_bytes", "ring_sent_bytes", "ring_steps", "zeropp_comm_bytes", "zeropp_cross_node_ratio",
    "zeropp_volume_paper",
]



# -- bytes per parameter in practice (notebook 12) ---------------------------------------------------------------
ADAM8BIT_BLOCK = 2048   # Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization": one fp32 absmax
#                         scale per block of 2048 values of each moment


def model_state_bytes_per_param(precision: str = "bf16", optimizer: str = "adam", grad_accum_dtype: str | None = None,
                                optimizer_bits: int = 32, master_weights: bool = True,
                                keep_low_precision_grads: bool = False, world_size: int = 1, stage: int = 0,
                                momentum: float = 0.0) -> dict[str, int | float]:
    """Model-state bytes per parameter on one rank, by category and "total" (padding aside: multiply by the padded
    element count to compare with a measurement).

    - parameters: the compute dtype's bytes (sharded at stage 3);
    - gradients: the accumulation buffer, `grad_accum_dtype` ("fp32" with bf16/fp16 compute: 4 bytes, DeepSpeed's
      data_types.grad_accum_dtype; None: the compute dtype), sharded from stage 2. `keep_low_precision_grads`
      adds the compute-dtype gradient autograd makes, kept whole next to an fp32 accumulator (an engine that
      moves gradients into it after backward instead of one parameter at a time: 16 -> 18 -> 20 bytes);
    - master_weights: the fp32 copy of 16-bit parameters (`master_weights=False`: none, "pure bf16");
    - optimizer_state: Adam's two moments at `optimizer_bits` each: 32 (8 bytes), 16 (4 bytes, pure bf16), or
      8 (2 bytes plus a 4-byte scale per ADAM8BIT_BLOCK values of each moment, 8-bit Adam); SGD: its momentum
      buffer if momentum > 0. Master weights and optimizer state are sharded from stage 1.
    """
    _check_stage(stage)
    _check_world(world_size)
    if grad_accum_dtype not in (None, *PRECISIONS):
        raise ValueError(f"grad_accum_dtype must be None or one of {sorted(PRECISIONS)}, got {grad_accum_dtype!r}.")
    p = param_bytes(precision)
    acc = param_bytes(grad_accum_dtype) if grad_accum_dtype else p
    low = p if keep_low_precision_grads and acc != p else 0
    if optimizer.lower() in {"adam", "adamw"}:
        if optimizer_bits not in (32, 16, 8):
            raise ValueError(f"optimizer_bits must be 32, 16 or 8 for Adam, got {optimizer_bits}.")
        state = Fraction(2 * optimizer_bits, 8)
        if optimizer_bits == 8:
            state += Fraction(2 * 4, ADAM8BIT_BLOCK)
    else:
        state = Fraction(optimizer_state_bytes(optimizer, momentum))
    n = Fraction(1, world_size)
    out = {
        "parameters": p * (n if stage >= 3 else 1),
        "gradients": acc * (n if stage >= 2 else 1) + low,
        "master_weights": (master_bytes(precision) if master_weights else 0) * (n if stage >= 1 else 1),
        "optimizer_state": state * (n if stage >= 1 else 1),
    }
    total = sum(out.values(), Fraction(0))
    return {**{k: _num(Fraction(v)) for k, v in out.items()}, "total": _num(total)}


__all__ += ["ADAM8BIT_BLOCK", "model_state_bytes_per_param"]
