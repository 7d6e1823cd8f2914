"""`zeroedu plan`: which ZeRO stage for which model, cluster and network, with the numbers behind the choice.

For every configuration (stages 0-3, optimizer offload, parameter offload, stage 3 + ZeRO++) the plan lists
the bytes per GPU by category, whether they fit, and the communication time per step, then recommends one:
the configuration that fits with the least communication time, preferring in turn no offload, then a lower
stage. Model states come from zeroedu.theory (exact, padded); activations are an estimate (documented in
`activation_bytes`); times come from the alpha-beta model (theory.collective_time) with the link constants
below or with ones fitted to measurements (`calibrate`); `predict_seconds` applies the same model to a list of
collectives, e.g. a live ledger's, to check it against the clock (notebook 13 does, on 4 gloo ranks).

    from zeroedu.theory.planner import plan, format_plan
    print(format_plan(plan("70B", gpus=16, gpus_per_node=8, gpu_memory_gb=80)))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from zeroedu import theory
from zeroedu.fmt import fmt_bytes
from zeroedu.i18n import tr
from zeroedu.theory import links

GB = theory.GB


# -- links --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A network link in the alpha-beta model: alpha = seconds per ring step, beta = bytes/s one way."""

    name: str
    alpha_s: float
    beta_bytes_per_s: float
    source: str

    def describe(self) -> str:
        return (f"{self.name}: alpha {self.alpha_s * 1e6:.1f} us, beta {self.beta_bytes_per_s / GB:.1f} GB/s "
                f"({self.source})")


# Nominal figures, one direction. Bandwidths are the vendors' peak numbers, kept with their sources in
# zeroedu.links (offload's table uses the same ones); achieved bus bandwidth is typically 70-90% of them. The
# alphas are orders of magnitude of a collective's per-step latency, not vendor figures: calibrate both with
# measurements (`calibrate`) when the answer depends on them.
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 5e-6, links.NVLINK3,
                   "NVIDIA A100 datasheet: NVLink 3 = 600 GB/s per GPU, both directions together"),
    "pcie": Link("pcie", 10e-6, links.PCIE4_X16,
                 "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding = 31.5 GB/s (PCI-SIG)"),
    "infiniband": Link("infiniband", 10e-6, links.INFINIBAND_NODE,
                       "per node: 8 x 200 Gb/s HDR InfiniBand ports for compute traffic (NVIDIA DGX A100 "
                       "user guide) = 200 GB/s"),
    "ethernet": Link("ethernet", 50e-6, links.ETHERNET_NODE,
                     "per node: one 100 Gb/s Ethernet port (IEEE 802.3) = 12.5 GB/s"),
    "nvme": Link("nvme", 100e-6, links.NVME_PCIE4_WRITE,   # one beta for both directions: the slower one
                 "one PCIe 4.0 x4 NVMe SSD per GPU: ~7 GB/s sequential read, ~6 GB/s write (vendor datasheets)"),
}
INTRA_DEFAULT, INTER_DEFAULT, HOST_DEFAULT, NVME_DEFAULT = "nvlink", "infiniband", "pcie", "nvme"


def link(spec: str | float | Link, role_default: str) -> Link:
    """A Link from a name in LINKS, a bandwidth in GB/s (the role's default alpha), or a Link."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, str) and spec.lower() in LINKS:
        return LINKS[spec.lower()]
    try:
        gbps = float(spec)
    except (TypeError, ValueError):
        raise ValueError(f"unknown link {spec!r}: use one of {sorted(LINKS)} or a bandwidth in GB/s") from None
    if gbps <= 0:
        raise ValueError(f"a link bandwidth must be positive, got {gbps} GB/s")
    base = LINKS[role_default]
    return Link(f"{gbps:g} GB/s", base.alpha_s, gbps * GB, f"bandwidth given; alpha of {base.name}")


def _collectives(samples: Iterable, need_seconds: bool) -> list[tuple[str, int, int, float]]:
    """(op, tensor bytes, world size, seconds) from tuples or ledger rows (a dict or a LedgerEntry)."""
    rows = []
    for s in samples:
        if isinstance(s, Mapping) or hasattr(s, "tensor_bytes"):
            get = s.get if isinstance(s, Mapping) else lambda k, s=s: getattr(s, k)
            op, nbytes, world, seconds = get("op"), get("tensor_bytes"), get("group_size"), get("seconds")
        elif len(s) in (3, 4):
            op, nbytes, world, *rest = s
            seconds = rest[0] if rest else None
        else:
            raise ValueError(f"a collective is (op, bytes, world_size[, seconds]) or a ledger row, got {s!r}")
        if need_seconds and seconds is None:
            raise ValueError(f"a sample needs its measured seconds: {s!r}")
        rows.append((op, int(nbytes), int(world), float(seconds or 0.0)))
    return rows


def calibrate(samples: Iterable, name: str = "measured", source: str = "the course's measurements") -> Link:
    """A Link fitted with theory.fit_alpha_beta to measured collectives.

    Each sample is (op, nbytes, world_size, seconds), nbytes being the full tensor's bytes, or a ledger row
    (a dict or LedgerEntry with op, tensor_bytes, group_size, seconds). Collectives that are not ring
    collectives (a broadcast) are left out of the fit."""
    rows = [r for r in _collectives(samples, need_seconds=True) if r[0] in theory.RING_OPS]
    alpha, beta = theory.fit_alpha_beta(rows)
    return Link(name, alpha, beta, f"fit to {len(rows)} collectives from {source}")


def predict_seconds(collectives: Iterable, link: Link | str = INTRA_DEFAULT) -> float:
    """The alpha-beta time of collectives run one after another on `link`: the sum of theory.collective_time.

    Each item is (op, tensor bytes, world_size) or a ledger row, e.g. the collectives of one step from
    `engine.ledger.select(step=1)`, so that the model can be checked against the clock of the same run."""
    lk = link if isinstance(link, Link) else LINKS[str(link).lower()] if str(link).lower() in LINKS else None
    if lk is None:
        raise ValueError(f"unknown link {link!r}: use one of {sorted(LINKS)}, or a Link (e.g. from calibrate)")
    total = 0.0
    for op, nbytes, world, _ in _collectives(collectives, need_seconds=False):
        if op not in theory.RING_OPS:
            raise ValueError(f"{op!r} is not one of the ring collectives the model knows ({sorted(theory.RING_OPS)}): "
                             f"leave it out, e.g. engine.ledger.select(step=1, kind='grads')")
        total += theory.collective_time(op, nbytes, world, lk.alpha_s, lk.beta_bytes_per_s)
    return total


# -- models and activations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    name: str
    psi: int
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    source: str = ""

    @property
    def has_architecture(self) -> bool:
        return None not in (self.layers, self.hidden, self.heads)


PRESETS: dict[str, ModelSpec] = {
    "1.3B": ModelSpec("GPT-3 XL", 1_300_000_000, 24, 2048, 24, 50257, "Brown et al. 2020, Table 2.1"),
    "7B": ModelSpec("Llama 2 7B", 6_738_415_616, 32, 4096, 32, 32000, "Touvron et al. 2023"),
    "13B": ModelSpec("Llama 2 13B", 13_015_864_320, 40, 5120, 40, 32000, "Touvron et al. 2023"),
    "70B": ModelSpec("Llama 2 70B", 68_976_648_192, 80, 8192, 64, 32000, "Touvron et al. 2023"),
    "175B": ModelSpec("GPT-3 175B", 175_000_000_000, 96, 12288, 96, 50257, "Brown et al. 2020, Table 2.1"),
}
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_model(model: str | int | float, layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, vocab: int | None = None) -> ModelSpec:
    """A preset name ("7B"), or a parameter count (7.5e9, "7.5B", "350M"); layers/hidden/heads/vocab override."""
    if isinstance(model, str) and model.upper() in PRESETS:
        spec = PRESETS[model.upper()]
    else:
        text = str(model).strip().upper()
        try:
            psi = float(text[:-1]) * _SUFFIX[text[-1]] if text[-1:] in _SUFFIX else float(text)
        except ValueError:
            raise ValueError(f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}) or a parameter "
                             f"count such as 7.5e9 or 7.5B") from None
        if psi < 1:
            raise ValueError(f"a model needs at least one parameter, got {model!r}")
        spec = ModelSpec(f"{psi / 1e9:g}B parameters", int(round(psi)), source="given")
    over = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab).items() if v is not None}
    return dataclasses.replace(spec, **over) if over else spec


def activation_bytes(spec: ModelSpec, seq_len: int, micro_batch: int, precision: str = "bf16",
                     recompute: bool = False, flash_attention: bool = False) -> int:
    """Activation bytes one GPU keeps for backward, for a GPT-style transformer without tensor parallelism.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1):
    a layer stores 34 s b h + 5 a s^2 b bytes with 16-bit activations and 1-byte dropout masks (s sequence,
    b micro-batch, h hidden, a heads). The 5 a s^2 b are the attention scores, softmax and its dropout mask,
    which FlashAttention does not store (`flash_attention`). With full recomputation a layer keeps only its
    input (2 s b h) and one layer's full activations are alive again during its backward. We add the output
    logits the loss keeps in fp32 (4 s b V) and double everything for fp32 training (an upper bound: masks
    stay 1 byte). Llama's SwiGLU MLP and grouped-query attention differ from this layer; it is an estimate.
    Returns 0 when the architecture is unknown (then the plan says activations were not estimated).
    """
    if not spec.has_architecture:
        return 0
    kept = theory.activation_bytes(seq_len, micro_batch, spec.hidden, spec.heads, spec.layers,
                                   "full" if recompute else "none", flash_attention)
    if theory.param_bytes(precision) == 4:
        kept *= 2
    return kept + 4 * seq_len * micro_batch * (spec.vocab or 0)


# -- the plan -----------------------------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    zeropp: bool = False
    device: dict[str, int] = field(default_factory=dict)        # bytes per GPU by category, activations kept
    host: dict[str, int] = field(default_factory=dict)          # model states per rank on the host
    nvme: dict[str, int] = field(default_factory=dict)
    model_states: int = 0                                       # parameters + gradients + master + optimizer
    activations: int = 0
    activations_recompute: int = 0
    total: int = 0                                              # device bytes without recomputation
    total_recompute: int = 0                                    # ... with full recomputation
    fits: bool = False
    fits_recompute: bool = False
    fits_host: bool = True
    comm_bytes: int = 0                                         # bytes this GPU sends per optimizer step
    cross_node_bytes: float = 0.0                               # of which to other nodes (per-rank average)
    comm_seconds: float = 0.0
    offload_bytes: int = 0                                      # host <-> device bytes per step
    offload_seconds: float = 0.0                                # PCIe and NVMe transfer time per step
    note: str = ""

    @property
    def fit_text(self) -> str:
        if not self.fits_host:
            return "no (host)"
        return "yes" if self.fits else ("recompute" if self.fits_recompute else "no")


@dataclass
class Plan:
    model: ModelSpec
    gpus: int
    gpus_per_node: int
    gpu_memory_gb: float
    usable_bytes: int
    precision: str
    micro_batch: int
    seq_len: int
    grad_accum: int
    intra: Link
    inter: Link
    host_link: Link
    nvme_link: Link
    rows: list[Row]
    recommendation: Row | None
    reason: str
    assumptions: str
    recompute: str = "auto"
    flash_attention: bool = False
    trainable: int | None = None        # parameters with gradients and optimizer state (None: all of them)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    def row(self, label: str) -> Row:
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"no row {label!r}; rows are {[r.label for r in self.rows]}")


CONFIGS = [  # label, stage, offload_optimizer, offload_param, zeropp
    ("stage 0", 0, "none", "none", False),
    ("stage 1", 1, "none", "none", False),
    ("stage 2", 2, "none", "none", False),
    ("stage 3", 3, "none", "none", False),
    ("stage 3 + ZeRO++", 3, "none", "none", True),
    ("stage 1 + offload opt", 1, "cpu", "none", False),
    ("stage 2 + offload opt", 2, "cpu", "none", False),
    ("stage 3 + offload opt", 3, "cpu", "none", False),
    ("stage 3 + offload opt+param", 3, "cpu", "cpu", False),
    ("stage 3 + NVMe opt+param", 3, "nvme", "nvme", False),
]


def _assumptions(spec: ModelSpec, headroom: float, bucket_numel: int, prefetch_numel: int,
                 flash: bool) -> list[str]:
    act = tr("activations: Korthikanti et al. 2022, 34sbh + 5as^2b bytes per layer (16-bit), "
             + ("without the 5as^2b term (FlashAttention), " if flash else "")
             + "plus 4sbV of fp32 logits; full recomputation keeps 2sbh per layer plus one layer",
             "激活值：Korthikanti et al. 2022，每层 34sbh + 5as^2b 字节（16 位）"
             + ("，去掉 5as^2b 项（FlashAttention）" if flash else "")
             + "，外加 4sbV 的 fp32 logits；完全重计算时每层保留 2sbh，再加一层")
    if not spec.has_architecture:
        act = tr("activations: NOT estimated (no layers/hidden/heads given): totals are model states and buffers",
                 "激活值：没有估算（没给 layers/hidden/heads）：总数只含模型状态和缓冲区")
    return [
        tr("GB = 1e9 bytes. Bytes are per GPU. Model states: zeroedu.theory (Adam: fp32 master + 2 fp32 moments).",
           "GB = 1e9 字节。字节数都是每卡。模型状态：zeroedu.theory（Adam：fp32 主权重 + 2 个 fp32 动量）。"),
        act,
        tr(f"fits: total <= (1 - {headroom:g}) x GPU memory; the headroom covers the CUDA context, the allocator's "
           "fragmentation and temporaries not listed",
           f"fits：total <= (1 - {headroom:g}) x 显存；余量留给 CUDA context、分配器的碎片和没有列出的临时张量"),
        tr(f"buckets: stage 2 holds two reduce buckets of min(psi, {bucket_numel:.3g}) elements, stage 3 two of "
           "that or of the largest unit if larger; stages 0-1 reduce in the gradient buffer itself (zeroedu's design)",
           f"桶：stage 2 保留两个 min(psi, {bucket_numel:.3g}) 个元素的归约桶，stage 3 保留两个这么大的桶（最大的 "
           "unit 更大时按它算）；stage 0-1 直接在梯度缓冲区里归约（zeroedu 的设计）"),
        tr("gathered parameters (stage 3): the largest unit (max of a 4h x h MLP matrix and the V x h embedding) "
           f"plus a prefetch of {prefetch_numel:.3g} elements, in the compute dtype",
           "gather 出来的参数（stage 3）：最大的 unit（4h x h 的 MLP 矩阵和 V x h 的 embedding 取大者）"
           f"加上 {prefetch_numel:.3g} 个元素的预取，按计算 dtype 算"),
        tr("comm time: alpha-beta per ring collective, one collective per bucket (stages 0-2); at stage 3 one "
           "all-gather per unit in forward and in backward (4 linear layers per block + embedding) and one "
           "reduce-scatter per bucket; across nodes a ring runs at min(intra, inter) where "
           "inter is one node's total bandwidth to the others (what one rank sends also leaves its node)",
           "通信时间：每次 ring 集合通信用 alpha-beta 模型，每个桶一次集合通信（stage 0-2）；stage 3 在前向和反向"
           "对每个 unit 各做一次 all-gather（每个 block 4 个线性层 + embedding），每个桶一次 reduce-scatter；"
           "跨节点时 ring 的速度是 min(intra, inter)，inter 指一个节点到其他节点的总带宽"
           "（一个 rank 发出的数据也要离开它的节点）"),
        tr("ZeRO++: qwZ int8 and qgZ int4 with fp32 scales per 2048 values, hpZ secondary partition per node "
           "(counted under parameters); quantization changes numerics: check convergence",
           "ZeRO++：qwZ 用 int8、qgZ 用 int4，每 2048 个值一个 fp32 scale；hpZ 每个节点一份二级分片"
           "（计入参数）；量化会改变数值：要检查收敛"),
        tr("offload: transfer time over one PCIe link per GPU and one NVMe drive per GPU, not overlapped; the "
           "CPU optimizer's own step time is not modeled",
           "offload：每卡一条 PCIe 链路、每卡一块 NVMe 盘的传输时间，不与计算重叠；CPU 优化器本身的 step 时间没有建模"),
    ]


@dataclass(frozen=True)
class _Cluster:
    """The GPUs a plan runs on and its links. A ring crosses the slowest link on its way: inter-node on several
    nodes."""
    gpus: int
    per_node: int            # ranks per node (a job on part of one node: its ranks are the node)
    intra: Link
    inter: Link
    host: Link
    nvme: Link

    @property
    def nodes(self) -> int:
        return self.gpus // self.per_node

    @property
    def ring_alpha(self) -> float:
        return self.intra.alpha_s if self.nodes == 1 else max(self.intra.alpha_s, self.inter.alpha_s)

    @property
    def ring_beta(self) -> float:
        return (self.intra.beta_bytes_per_s if self.nodes == 1
                else min(self.intra.beta_bytes_per_s, self.inter.beta_bytes_per_s))


@dataclass(frozen=True)
class _Workload:
    """What every row shares: the model's size, its precision, how it is cut into buckets and units."""
    psi: int
    precision: str
    grad_accum: int
    optimizer: str
    bucket_numel: int
    prefetch_numel: int
    max_live_numel: int
    largest_unit: int        # stage 3's biggest gathered unit (an MLP matrix or the embedding)
    n_buckets: int
    n_units: int
    activations: int
    activations_recompute: int
    trainable: int           # parameters with gradients and optimizer state (psi unless some are frozen)


def _check_cluster(gpus: int, gpus_per_node: int, headroom: float) -> None:
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"gpus and gpus_per_node must be >= 1, got {gpus} and {gpus_per_node}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs are not whole nodes of {gpus_per_node}: use a multiple of gpus_per_node")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction of GPU memory in [0, 1), got {headroom}")


def _workload(spec: ModelSpec, precision: str, micro_batch: int, seq_len: int, grad_accum: int, optimizer: str,
              flash_attention: bool, bucket_numel: int, prefetch_numel: int, max_live_numel: int,
              trainable: int | float | None = None) -> _Workload:
    psi, h, v = spec.psi, spec.hidden, spec.vocab
    if trainable is None:
        train = psi
    else:
        train = int(round(trainable * psi)) if trainable <= 1 else int(trainable)
        if not 0 < train <= psi:
            raise ValueError(f"trainable must be a count in 1..{psi} or a fraction in (0, 1], got {trainable}")
    largest_unit = min(psi, max(4 * h * h, (v or 0) * h)) if spec.has_architecture else min(psi, bucket_numel)
    n_buckets = math.ceil(psi / bucket_numel)
    n_units = 4 * spec.layers + (1 if v else 0) if spec.has_architecture else n_buckets
    return _Workload(psi, precision, grad_accum, optimizer, bucket_numel, prefetch_numel, max_live_numel,
                     largest_unit, n_buckets, n_units,
                     activation_bytes(spec, seq_len, micro_batch, precision, False, flash_attention),
                     activation_bytes(spec, seq_len, micro_batch, precision, True, flash_attention), train)


def _comm_sent(stage: int, w: _Workload, c: _Cluster) -> dict:
    """Bytes sent per step: the trainable parameters' gradients (and their updated values at stages 1-2); at
    stage 3 every parameter's gathers and the trainable ones' reduce-scatter."""
    sent = theory.comm_bytes_per_step(w.psi if stage == 3 else w.trainable, c.gpus, stage, w.precision, w.grad_accum)
    if stage == 3 and w.trainable != w.psi:
        sent["backward/reduce_scatter"] = theory.comm_bytes_per_step(w.trainable, c.gpus, 3, w.precision,
                                                                     w.grad_accum)["backward/reduce_scatter"]
        sent["total"] = sum(v for k, v in sent.items() if k != "total")
    return sent


def _ring_seconds(stage: int, w: _Workload, c: _Cluster) -> float:
    """alpha-beta time of a step's ring collectives: one latency per ring step of every call, plus bytes / beta."""
    sent = _comm_sent(stage, w, c)
    count = {"backward/all_reduce": w.n_buckets, "step/all_gather": w.n_buckets,
             "backward/reduce_scatter": w.n_buckets * (w.grad_accum if stage == 2 else 1)}
    if stage == 3:
        count = {"forward/all_gather": w.n_units * w.grad_accum, "backward/all_gather": w.n_units * w.grad_accum,
                 "backward/reduce_scatter": w.n_buckets * w.grad_accum}
    t = 0.0
    for key, nbytes in sent.items():
        if key != "total":
            op = key.split("/")[1]
            t += count[key] * theory.ring_steps(op, c.gpus) * c.ring_alpha + nbytes / c.ring_beta
    return t


def _zeropp_seconds(z: dict, w: _Workload, c: _Cluster) -> float:
    """alpha-beta time of ZeRO++'s collectives, each on the links its algorithm uses."""
    t = 0.0
    for coll in z["collectives"]:
        intra_b, cross_b = float(coll["intra_node"]), float(coll["cross_node"])
        if coll["algorithm"] == "ring":
            t += w.n_units * coll["steps"] * c.ring_alpha + (intra_b + cross_b) / c.ring_beta
        elif coll["algorithm"] == "node_ring":
            t += w.n_units * coll["steps"] * c.intra.alpha_s + intra_b / c.intra.beta_bytes_per_s
        else:   # two hops: inside the node, then each node's ranks send g x cross_b through its links out
            t += w.n_units * w.grad_accum * ((c.per_node - 1) * c.intra.alpha_s + (c.nodes - 1) * c.inter.alpha_s)
            t += intra_b / c.intra.beta_bytes_per_s + (c.per_node * cross_b / c.inter.beta_bytes_per_s
                                                       if c.nodes > 1 else 0.0)
    return t


def _device_bytes(stage: int, tiers: dict, w: _Workload) -> dict[str, int]:
    """Model states left on the device, plus stage 2's and 3's bucket buffers and stage 3's gathered parameters."""
    p = theory.param_bytes(w.precision)
    dev = {k: tiers["device"][k] for k in theory.MODEL_STATES}
    reduce_bucket = min(w.psi, w.bucket_numel)
    dev["buckets"] = 2 * p * {2: reduce_bucket, 3: max(w.largest_unit, reduce_bucket)}.get(stage, 0)
    dev["gathered_parameters"] = (p * min(w.max_live_numel, w.largest_unit + w.prefetch_numel, w.psi)
                                  if stage == 3 else 0)
    return dev


def _row(config: tuple, w: _Workload, c: _Cluster, usable: int, recompute: str, headroom: float,
         host_memory_gb: float | None) -> Row:
    """One configuration of CONFIGS: its bytes per GPU, whether it fits, its communication and offload time."""
    label, stage, oo, op, zpp = config
    tiers = theory.offload_bytes(w.psi, c.gpus, stage, w.precision, oo, op, optimizer=w.optimizer)
    if w.trainable != w.psi:    # frozen parameters: their bytes only; the rest of the model states for the trainable
        part = theory.offload_bytes(w.trainable, c.gpus, stage, w.precision, oo, op, optimizer=w.optimizer)
        for tier in ("device", "host", "nvme"):
            tiers[tier] = {"parameters": tiers[tier]["parameters"],
                           **{k: part[tier][k] for k in theory.MODEL_STATES if k != "parameters"}}
            tiers[tier]["total"] = sum(tiers[tier][k] for k in theory.MODEL_STATES)
    dev = _device_bytes(stage, tiers, w)
    note = ""
    if zpp:
        # hpZ keeps the backward gather inside a node: on one node there is nothing to keep it from.
        z = theory.zeropp_comm_bytes(w.psi, c.gpus, c.per_node, qwz=True, hpz=c.nodes > 1, qgz=True,
                                     precision=w.precision, grad_accum=w.grad_accum)
        dev["parameters"] += z["hpz_secondary_bytes"]
        comm, cross, seconds = int(round(float(z["total"]))), float(z["cross_node"]), _zeropp_seconds(z, w, c)
        secondary = f"{z['hpz_secondary_bytes'] / GB:.2f}"
        note = (tr(f"hpZ secondary copy {secondary} GB counted under parameters",
                   f"hpZ 的二级副本 {secondary} GB 计入参数") if c.nodes > 1 else
                tr("one node: qwZ and qgZ only (hpZ has no cross-node gather to remove)",
                   "单节点：只有 qwZ 和 qgZ（hpZ 没有跨节点的 gather 可省）"))
    else:
        comm = int(_comm_sent(stage, w, c)["total"])
        cross = comm / c.per_node if c.nodes > 1 else 0.0
        seconds = _ring_seconds(stage, w, c)
    model_states = sum(dev[k] for k in theory.MODEL_STATES)
    base = sum(dev.values())
    act, act_rc = w.activations, w.activations_recompute
    row = Row(label, stage, oo, op, zpp, {**dev, "activations": act}, tiers["host"], tiers["nvme"],
              model_states, act, act_rc, base + act, base + act_rc, comm_bytes=comm, cross_node_bytes=cross,
              comm_seconds=seconds, note=note)
    row.fits, row.fits_recompute = row.total <= usable, row.total_recompute <= usable
    if recompute == "none":
        row.fits_recompute = row.fits
    elif recompute == "full":
        row.fits = False     # the policy is full recomputation: only tot-rc counts
    if host_memory_gb is not None:
        row.fits_host = row.host["total"] * c.per_node <= (1 - headroom) * host_memory_gb * GB
    if oo != "none":
        moved = theory.offload_transfer_bytes_per_step(w.psi if op != "none" else w.trainable, c.gpus, stage,
                                                       w.precision, oo, op, w.grad_accum, optimizer=w.optimizer)
        row.offload_bytes = moved["host_device"]
        row.offload_seconds = (moved["host_device"] / c.host.beta_bytes_per_s
                               + moved["nvme"] / c.nvme.beta_bytes_per_s)
    return row


def plan(model: str | int | float = "7B", gpus: int = 8, gpus_per_node: int = 8, gpu_memory_gb: float = 80.0,
         intra: str | float | Link = INTRA_DEFAULT, inter: str | float | Link = INTER_DEFAULT,
         host_link: str | float | Link = HOST_DEFAULT, precision: str = "bf16", micro_batch: int = 1,
         seq_len: int = 2048, grad_accum: int = 1, optimizer: str = "adam", headroom: float = 0.10,
         layers: int | None = None, hidden: int | None = None, heads: int | None = None, vocab: int | None = None,
         flash_attention: bool = False, bucket_numel: int = 50_000_000, prefetch_numel: int = 50_000_000,
         max_live_numel: int = 1_000_000_000, host_memory_gb: float | None = None, recompute: str = "auto",
         trainable: int | float | None = None) -> Plan:
    """Every configuration's bytes per GPU, fit and communication time, and the recommended one.

    Activations count in every "fits": seq_len, micro_batch, flash_attention and `recompute` set them.
    recompute="none" or "full" fixes the activation policy (a row fits only with it); "auto" tries each
    configuration without recomputation first, then with full recomputation (the recommendation says which).
    `trainable`: how many parameters train (a count, or a fraction of the model if at most 1), the rest frozen,
    as with LoRA/PEFT adapters: every parameter is held in the compute dtype (sharded at stage 3 only), but
    gradients, master weights and optimizer state exist only for the trainable ones, and so does the gradient
    traffic (stage 3 still gathers every parameter in forward and backward). ZeRO++ rows count the whole model."""
    if recompute not in {"auto", "none", "full"}:
        raise ValueError(f"recompute must be 'auto', 'none' or 'full', got {recompute!r}")
    spec = parse_model(model, layers, hidden, heads, vocab)
    n, g = int(gpus), int(gpus_per_node)
    _check_cluster(n, g, headroom)
    cluster = _Cluster(n, min(g, n), link(intra, INTRA_DEFAULT), link(inter, INTER_DEFAULT),
                       link(host_link, HOST_DEFAULT), LINKS[NVME_DEFAULT])
    usable = int((1 - headroom) * gpu_memory_gb * GB)
    work = _workload(spec, precision, micro_batch, seq_len, grad_accum, optimizer, flash_attention, bucket_numel,
                     prefetch_numel, max_live_numel, trainable)
    rows = [_row(config, work, cluster, usable, recompute, headroom, host_memory_gb) for config in CONFIGS]
    best, reason = _recommend(rows, usable, gpu_memory_gb, headroom, spec, cluster.nodes, recompute)
    assumptions = "\n".join(f"- {a}" for a in _assumptions(spec, headroom, bucket_numel, prefetch_numel,
                                                           flash_attention))
    return Plan(spec, n, int(gpus_per_node), gpu_memory_gb, usable, precision, micro_batch, seq_len, grad_accum,
                cluster.intra, cluster.inter, cluster.host, cluster.nvme, rows, best, reason, assumptions, recompute,
                flash_attention, None if work.trainable == spec.psi else work.trainable)


def _gb(x: float) -> str:
    return fmt_bytes(x, "GB", 1, grouping=False)


def _recommend(rows: list[Row], usable: int, gpu_memory_gb: float, headroom: float, spec: ModelSpec,
               nodes: int, policy: str = "auto") -> tuple[Row | None, str]:
    """Tiers, best first: exact stages that fit as they are; exact stages with full recomputation; offload
    (CPU before NVMe) as it is, then with recomputation. Within a tier: least communication time, then the
    lower stage. ZeRO++ is quantized, so it is offered in the reason rather than chosen."""
    exact = [r for r in rows if r.offload_optimizer == "none" and not r.zeropp]
    cpu = [r for r in rows if r.offload_optimizer == "cpu"]
    nvme = [r for r in rows if r.offload_optimizer == "nvme"]
    tiers = [(exact, False), (exact, True), (cpu, False), (cpu, True), (nvme, False), (nvme, True)]
    budget = tr(f"{_gb(usable)} usable per GPU ({gpu_memory_gb:g} GB less {headroom:.0%} headroom)",
                f"每卡可用的 {_gb(usable)}（{gpu_memory_gb:g} GB 减去 {headroom:.0%} 的余量）")
    for group, recompute in tiers:
        if recompute and policy == "none":
            continue
        ok = [r for r in group if r.fits_host and (r.fits_recompute if recompute else r.fits)]
        if not ok:
            continue
        best = min(ok, key=lambda r: (round(r.comm_seconds, 12), r.stage, r.offload_param != "none"))
        need = best.total_recompute if recompute else best.total
        words = [tr(f"{best.label} is the first configuration that fits: {_gb(need)} per GPU "
                    f"{'with full activation recomputation ' if recompute else ''}within {budget}.",
                    f"{best.label} 是第一个放得下的配置：每卡 {_gb(need)}"
                    f"{'（完全激活重计算）' if recompute else ''}，在{budget}之内。")]
        smaller = [r for r in exact if r.stage < best.stage]
        if smaller:
            listed = ", ".join(f"{r.label} {_gb(r.total_recompute if recompute else r.total)}" for r in smaller)
            words.append(tr(f"Smaller stages need {listed}.", f"更低的 stage 需要：{listed}。"))
        if recompute:
            words.append(tr(f"Without recomputation it needs {_gb(best.total)}; recomputation costs about one "
                            "more forward pass per step.",
                            f"不做重计算需要 {_gb(best.total)}；重计算每步大约多花一次前向。"))
        offl = f"{best.offload_seconds:.3g}"
        words.append(tr(f"It sends {_gb(best.comm_bytes)} per GPU per step, about {best.comm_seconds:.3g} s"
                        + (f", plus {offl} s of host/NVMe transfers and the CPU optimizer step"
                           if best.offload_optimizer != "none" else "") + ".",
                        f"它每卡每步发送 {_gb(best.comm_bytes)}，约 {best.comm_seconds:.3g} s"
                        + (f"，另加 {offl} s 的 host/NVMe 传输和 CPU 优化器 step"
                           if best.offload_optimizer != "none" else "") + "。"))
        zpp = next(r for r in rows if r.zeropp)
        if nodes > 1 and best.stage == 3 and best.offload_optimizer == "none" and zpp.comm_seconds < best.comm_seconds \
                and (zpp.fits_recompute if recompute else zpp.fits):
            words.append(tr(f"Stage 3 + ZeRO++ would cut that to about {zpp.comm_seconds:.3g} s (quantized weights "
                            "and gradients: check convergence).",
                            f"stage 3 + ZeRO++ 能把它降到约 {zpp.comm_seconds:.3g} s"
                            "（权重和梯度被量化：要检查收敛）。"))
        if not spec.has_architecture:
            words.append(tr("Activations were not estimated: give --layers, --hidden and --heads.",
                            "没有估算激活值：请给出 --layers、--hidden 和 --heads。"))
        return best, tr(" ", "").join(words)
    last = next(r for r in rows if r.offload_optimizer == "nvme")
    need, act = (last.total, last.activations) if policy == "none" else (last.total_recompute,
                                                                         last.activations_recompute)
    how = tr("without recomputation", "不做重计算") if policy == "none" else tr("with full recomputation", "完全重计算")
    return None, tr(f"Nothing fits in {budget}: even {last.label} needs {_gb(need)} per GPU {how} "
                    f"({_gb(act)} of it activations). Use more GPUs, a smaller micro-batch or sequence, "
                    + ("allow recomputation, " if policy == "none" else "")
                    + "or add tensor/pipeline (sequence/context) parallelism.",
                    f"在{budget}之内什么都放不下：即使 {last.label}，{how}时每卡也需要 {_gb(need)}"
                    f"（其中激活值 {_gb(act)}）。请用更多的卡、更小的 micro-batch 或更短的序列，"
                    + ("允许重计算，" if policy == "none" else "")
                    + "或者加上张量/流水线（序列/上下文）并行。")


# -- output -------------------------------------------------------------------------------------------------
COLUMNS = [("config", 28), ("params", 7), ("grads", 7), ("optim", 7), ("bufs", 6), ("model", 7), ("act", 7),
           ("act-rc", 7), ("total", 7), ("tot-rc", 7), ("fits", 10), ("host", 7), ("comm", 7), ("comm s", 8),
           ("offl s", 8)]


def format_plan(p: Plan) -> str:
    """The plan as a fixed-width table (GB = 1e9 bytes, per GPU) with the recommendation and its assumptions."""
    m = p.model
    arch = (tr(f"; {m.layers} layers, hidden {m.hidden}, {m.heads} heads", f"；{m.layers} 层，hidden {m.hidden}，"
               f"{m.heads} 个头") + (tr(f", vocab {m.vocab}", f"，vocab {m.vocab}") if m.vocab else "")
            if m.has_architecture else "")
    per = min(p.gpus, p.gpus_per_node)
    nodes = tr(f"{p.nodes} node{'s' if p.nodes > 1 else ''} of {per}", f"{p.nodes} 个节点，每节点 {per} 张")
    source = f" [{m.source}]" if m.source else ""
    lines = [
        tr(f"zeroedu plan: {m.name} ({m.psi:.3g} parameters{arch}){source}",
           f"zeroedu plan：{m.name}（{m.psi:.3g} 个参数{arch}）{source}"),
        tr(f"{p.gpus} GPUs ({nodes}), {p.gpu_memory_gb:g} GB each; {p.precision}, micro-batch {p.micro_batch} x "
           f"{p.seq_len} tokens, gradient accumulation {p.grad_accum}"
           + (f"; {p.trainable:.3g} trainable parameters, the rest frozen" if p.trainable else ""),
           f"{p.gpus} 张卡（{nodes}），每张 {p.gpu_memory_gb:g} GB；{p.precision}，micro-batch {p.micro_batch} x "
           f"{p.seq_len} 个 token，梯度累积 {p.grad_accum}"
           + (f"；{p.trainable:.3g} 个可训练参数，其余冻结" if p.trainable else "")),
        tr("GB per GPU (1 GB = 1e9 bytes); model = params + grads + optim (master weights and optimizer state);",
           "每卡 GB 数（1 GB = 1e9 字节）；model = params + grads + optim（fp32 主权重和优化器状态）；"),
        tr("bufs = buckets + gathered parameters; act/-rc = activations without/with full recomputation;",
           "bufs = 桶 + gather 出来的参数；act/-rc = 不做/完全做激活重计算时的激活值；"),
        tr("host = model states offloaded to host and NVMe; comm = GB each GPU sends per step;",
           "host = offload 到 host 和 NVMe 的模型状态；comm = 每卡每步发送的 GB 数；"),
        tr("comm s / offl s = seconds per step on the network / moving offloaded states (PCIe, NVMe)",
           "comm s / offl s = 每步花在网络上 / 搬运 offload 状态（PCIe、NVMe）上的秒数"),
        "",
    ]
    lines.append(" ".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(COLUMNS)))
    lines.append("-" * len(lines[-1]))
    for r in p.rows:
        d = r.device
        vals = [d["parameters"], d["gradients"], d["master_weights"] + d["optimizer_state"],
                d["buckets"] + d["gathered_parameters"], r.model_states, r.activations, r.activations_recompute,
                r.total, r.total_recompute]
        cells = [r.label.ljust(COLUMNS[0][1])] + [f"{v / GB:{w}.1f}" for v, (_, w) in zip(vals, COLUMNS[1:10],
                                                                                        strict=True)]
        cells += [r.fit_text.rjust(10), f"{(r.host['total'] + r.nvme['total']) / GB:7.1f}",
                  f"{r.comm_bytes / GB:7.1f}", f"{r.comm_seconds:8.3g}",
                  f"{r.offload_seconds:8.3g}" if r.offload_optimizer != "none" else " " * 7 + "-"]
        lines.append(" ".join(cells))
    # activations are the same in every configuration: their own row, in the act columns
    r0, flash = p.rows[0], p.flash_attention
    lines.append("activations".ljust(COLUMNS[0][1]) + " " * (sum(w + 1 for _, w in COLUMNS[1:6]))
                 + f"{r0.activations / GB:7.1f} {r0.activations_recompute / GB:7.1f}   "
                 + tr(f"(per GPU, {p.micro_batch} x {p.seq_len} tokens{', fused attention' if flash else ''}; "
                      f"recompute: {p.recompute})",
                      f"（每卡，{p.micro_batch} x {p.seq_len} 个 token{'，fused attention' if flash else ''}；"
                      f"重计算：{p.recompute}）"))
    pick = p.recommendation.label if p.recommendation else tr("none", "无")
    lines += ["", tr(f"Recommendation: {pick}", f"推荐：{pick}"), p.reason, ""]
    lines += [tr("Links (alpha-beta model):", "链路（alpha-beta 模型）："), f"- intra-node {p.intra.describe()}",
              f"- inter-node {p.inter.describe()}", f"- host {p.host_link.describe()}",
              f"- nvme {p.nvme_link.describe()}", ""]
    lines += [tr("Assumptions:", "假设："), p.assumptions]
    notes = [f"- {r.label}: {r.note}" for r in p.rows if r.note]
    return "\n".join(lines + notes)


def plan_dict(p: Plan) -> dict:
    """The plan as plain data (for --json)."""
    out = dataclasses.asdict(p)
    out["recommendation"] = p.recommendation.label if p.recommendation else None
    return out


# -- CLI ----------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="zeroedu plan", description="Which ZeRO stage for which model, cluster "
                                 "and network: bytes per GPU, fit, communication time, recommendation.")
    ap.add_argument("--model", default="7B", help=f"a preset ({', '.join(PRESETS)}) or a parameter count "
                    "(7.5e9, 7.5B, 350M)")
    ap.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs (N)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--intra", default=INTRA_DEFAULT, help="intra-node link: nvlink, pcie or GB/s")
    ap.add_argument("--inter", default=INTER_DEFAULT, help="one node's bandwidth to the others: infiniband, "
                    "ethernet or GB/s")
    ap.add_argument("--host-link", default=HOST_DEFAULT, help="GPU-host link for offload: pcie or GB/s")
    ap.add_argument("--precision", default="bf16", choices=sorted(theory.PRECISIONS))
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory kept free")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--flash-attention", action="store_true", help="attention scores are not stored")
    ap.add_argument("--recompute", default="auto", choices=["auto", "none", "full"],
                    help="activation recomputation: none, full, or auto (none if it fits, else full)")
    ap.add_argument("--host-memory-gb", type=float, help="host RAM per node; offload rows must fit it too")
    ap.add_argument("--intra-samples", help="JSON file of measured collectives within a node: a list of "
                    "[op, bytes, world_size, seconds] or of ledger rows; replaces the intra-node link")
    ap.add_argument("--inter-samples", help="the same, measured across nodes; replaces the inter-node link")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _samples(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "samples" in data:
        data = data["samples"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of [op, bytes, world_size, seconds] or ledger rows")
    return data


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        intra = calibrate(_samples(args.intra_samples), source=args.intra_samples) if args.intra_samples \
            else args.intra
        inter = calibrate(_samples(args.inter_samples), source=args.inter_samples) if args.inter_samples \
            else args.inter
        result = plan(args.model, args.gpus, args.gpus_per_node, args.gpu_memory_gb, intra, inter, args.host_link,
                      args.precision, args.micro_batch, args.seq_len, args.grad_accum, headroom=args.headroom,
                      layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                      flash_attention=args.flash_attention, host_memory_gb=args.host_memory_gb,
                      recompute=args.recompute)
    except (ValueError, OSError) as e:
        print(f"zeroedu plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_dict(result), indent=1) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
