"""ZeRO++: stage 3 with less cross-node traffic (qwZ, hpZ, qgZ), and what each costs.

Stage 3 moves 3 Psi per step, and on a cluster all three collectives span every node, so all of it crosses the
slow links between nodes: a forward all-gather of the parameters, a backward all-gather, a reduce-scatter of
the gradients. ZeRO++ (Wang et al., 2023) attacks each one:

- qwZ, `zero_quantized_weights`: each rank block-quantizes its parameter shard to int8 (one fp32 scale per
  block of WEIGHT_BLOCK elements) before the all-gather and every rank dequantizes what arrives. Half the bytes
  of a 16-bit all-gather, a quarter of an fp32 one, plus the scales. Costs rounding error in the weights that
  the forward uses; the fp32 master weights and the optimizer never see it.
- hpZ, `zero_hpz_partition_size` = M: besides its 1/N primary shard, each rank keeps a secondary 1/M shard of
  the parameters, partitioned inside its group of M ranks (its "node"). The secondary copy is cut from the
  full parameters that the forward all-gather brought anyway, so it costs memory (Psi/M elements per rank)
  and no traffic; the backward all-gather then runs inside the node. Exact: the same bytes arrive.
- qgZ, `zero_quantized_gradients`: the gradient reduce-scatter becomes two all-to-alls of GRAD_BITS-bit
  blocks: inside the node (each rank receives the slices it will represent across nodes, from every node
  peer, and sums them), then across nodes (one rank per node, each node sending its node-sums). Every hop
  quantizes before sending and dequantizes and sums in fp32 after: one quantization error per hop, where a
  quantized ring reduce-scatter would add one per ring step.

Which collectives span nodes: `split_cross_node(ledger, node_size)` (one rank's ledger, by each entry's group).
Which bytes leave a node: `where_bytes_go(ledgers, node_size)` (every rank's ledger; the keys of
zeroedu.theory.zeropp_comm_bytes, so measured and theory print side by side: the paper's 3M -> 0.75M).

The knobs are module constants, as DeepSpeed keeps them internal too (its config has only the three switches).
Their defaults live in zeroedu.vocab (ZEROPP_*), so the engine and the closed form agree. Set them before
`initialize`, inside the function that runs on the ranks (a rank does not see a change made in the notebook's
own process): each engine reads them once, when it is built, and checks them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial

import torch

from zeroedu.comm import Comm, Ledger
from zeroedu.engine.flat import Bucket
from zeroedu.engine.stages.units import GatherSource
from zeroedu.theory.vocab import ZEROPP_BLOCK_SIZE, ZEROPP_GRAD_BITS, ZEROPP_WEIGHT_BITS

WEIGHT_BITS = ZEROPP_WEIGHT_BITS
"""qwZ code width, 8 (as in DeepSpeed: symmetric codes in [-127, 127]) or 4."""
WEIGHT_BLOCK = ZEROPP_BLOCK_SIZE
"""qwZ block: elements that share one fp32 scale. Smaller blocks follow the data closely (less error) and
cost more scale bytes: 4 bytes per block, 0.2% of the int8 payload at 2048, 1.6% at 256."""
GRAD_BITS = ZEROPP_GRAD_BITS
"""qgZ code width, 4 or 8. int4 (codes in [-7, 7], two per byte) is the paper's choice."""
GRAD_BLOCK = ZEROPP_BLOCK_SIZE
"""qgZ block: elements of a gradient slice that share one fp32 scale."""
NODE_SIZE: int | None = None
"""Ranks per node when the config has no hpZ (hpZ's partition size is the node when it is set). None: the
LOCAL_WORLD_SIZE that torchrun sets (zeroedu.launch sets it to the world size: one node). Set it to 2 to
pretend that 4 ranks on one machine are 2 nodes of 2."""


# -- block quantization ----------------------------------------------------------------------------------------

def levels(bits: int) -> int:
    """The largest code of a symmetric `bits`-bit quantizer: 127 for int8, 7 for int4."""
    if bits not in (4, 8):
        raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric block quantization along the last dimension.

    Each block of `block` elements (the last one may be shorter) gets scale = max|x| / L with L = levels(bits),
    and codes round(x / scale) in [-L, L]. Returns (codes int8 shaped like x, scales fp32 (..., blocks)).
    Error bound: |x - dequantize(...)| <= max|x over its block| / (2 L), plus fp32 rounding. A block of zeros
    has scale 0 and decodes to exact zeros. A non-finite value makes its block's scale inf or nan, so the
    whole block decodes to nan: an fp16 overflow still shows in the gradient norm.
    """
    L = levels(bits)
    n = x.shape[-1]
    nb = math.ceil(n / block)
    xp = torch.nn.functional.pad(x.float(), (0, nb * block - n)).reshape(*x.shape[:-1], nb, block)
    scales = xp.abs().amax(dim=-1) / L
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))   # zeros stay zeros, no 0/0
    codes = torch.round(xp / safe.unsqueeze(-1)).clamp_(-L, L).to(torch.int8)
    return codes.reshape(*x.shape[:-1], nb * block)[..., :n], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values from codes and per-block scales (the inverse of `quantize`, up to its error bound)."""
    n = codes.shape[-1]
    per_element = scales.repeat_interleave(block, dim=-1)[..., :n]
    return codes.float() * per_element


def payload_bytes(n: int, bits: int, block: int) -> int:
    """Bytes on the wire for n quantized elements: the codes (bits/8 each, rounded up) and 4 per scale."""
    return math.ceil(n * bits / 8) + 4 * math.ceil(n / block)


def pack(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 message per row: the codes (int4: two per byte, low nibble first) then the scales' bytes."""
    if bits == 4:
        u = (codes.to(torch.int16) + 8).to(torch.uint8)         # [-7, 7] -> [1, 15]
        if u.shape[-1] % 2:
            u = torch.nn.functional.pad(u, (0, 1))
        data = u[..., 0::2] | (u[..., 1::2] << 4)
    else:
        data = codes.view(torch.uint8)
    return torch.cat([data, scales.contiguous().view(torch.uint8)], dim=-1)


def unpack(payload: torch.Tensor, n: int, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of n elements from messages made by `pack` (rows along the first dimensions)."""
    nd = math.ceil(n * bits / 8)
    data, scale_bytes = payload[..., :nd], payload[..., nd:].clone()   # a copy: fp32 views need alignment
    if bits == 4:
        u = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], 2 * nd)[..., :n]
        codes = (u.to(torch.int16) - 8).to(torch.int8)
    else:
        codes = data.contiguous().view(torch.int8)
    return codes, scale_bytes.view(torch.float32)


class BlockQuantizer:
    """The quantizer an engine's qwZ and qgZ use (`ZeroPPMixin.quantizer`): `quantize` and `dequantize` above.
    Another object with these two methods (an exercise's, an instrumented one) can take its place on an engine
    class, without touching this module."""

    def quantize(self, x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(x, bits, block)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
        return dequantize(codes, scales, block)


def compress(x: torch.Tensor, bits: int, block: int, quantizer: BlockQuantizer | None = None) -> torch.Tensor:
    """x (rows along the first dimensions) as uint8 messages of payload_bytes(x.shape[-1], bits, block)."""
    return pack(*(quantizer or BlockQuantizer()).quantize(x, bits, block), bits)


def decompress(payload: torch.Tensor, n: int, bits: int, block: int,
               quantizer: BlockQuantizer | None = None) -> torch.Tensor:
    return (quantizer or BlockQuantizer()).dequantize(*unpack(payload, n, bits, block), block)


# -- where the bytes go ----------------------------------------------------------------------------------------

def node_of(rank: int, node_size: int) -> int:
    """Ranks are numbered node by node (as torchrun does): ranks 0..node_size-1 are node 0."""
    return rank // node_size


def split_cross_node(ledger: Ledger, node_size: int) -> dict[str, Ledger]:
    """{"cross_node": entries whose group spans more than one node, "intra_node": the rest}.

    A collective over a group that spans nodes is paced by the links between them: every step of a ring
    moves the same bytes over every link, the slow one included. So the whole `sent_bytes` of such an entry
    counts as cross-node traffic for the rank that ran it.
    """
    out = {"cross_node": Ledger(), "intra_node": Ledger()}
    for e in ledger:
        nodes = {node_of(r, node_size) for r in e.group}
        out["cross_node" if len(nodes) > 1 else "intra_node"].append(e)
    return out


def where_bytes_go(ledgers: list[Ledger], node_size: int, step: int | None = None,
                   kinds: tuple[str, ...] = ("params", "grads")) -> dict:
    """Bytes by where their receiver lives, from every rank's ledger (list index = rank), per optimizer step.

    Returns the keys of zeroedu.theory.zeropp_comm_bytes: "intra_node" and "cross_node" (bytes a rank sent to
    a rank on its own node / on another node, averaged over ranks), "total", "cross_node_per_node" (bytes one
    node's ranks send to other nodes: the traffic on a node's links to the cluster, the quantity behind the
    paper's "3M -> 0.75M"), and "per_node" (that figure for each node). A ring (all-gather, reduce-scatter,
    all-reduce) sends everything to the next rank of its group, so in a ring over all ranks only the rank
    whose neighbour lives on another node sends off-node; an all-to-all sends an equal slice to every other
    member. `step=None` adds up every step. Averages are exact fractions, shown as int when whole.
    """
    from fractions import Fraction

    n = len(ledgers)
    per_node = [0] * math.ceil(n / node_size)
    total = 0
    for rank, ledger in enumerate(ledgers):
        home = node_of(rank, node_size)
        for e in ledger:
            if e.kind not in kinds or (step is not None and e.step != step) or e.group_size < 2:
                continue
            total += e.sent_bytes
            if e.op == "all_to_all":
                away = sum(node_of(r, node_size) != home for r in e.group)
                per_node[home] += e.sent_bytes * away // (e.group_size - 1)
            elif e.op in ("all_gather", "reduce_scatter", "all_reduce"):
                right = e.group[(e.group.index(rank) + 1) % e.group_size]
                if node_of(right, node_size) != home:
                    per_node[home] += e.sent_bytes
            else:
                raise ValueError(f"where_bytes_go does not know where a {e.op!r} sends; pass kinds= without it")

    def num(x: Fraction) -> int | float:
        return int(x) if x.denominator == 1 else float(x)

    cross = Fraction(sum(per_node), n)
    return {"intra_node": num(Fraction(total, n) - cross), "cross_node": num(cross), "total": num(Fraction(total, n)),
            "cross_node_per_node": num(Fraction(sum(per_node), len(per_node))), "per_node": per_node}


# -- the engine ----------------------------------------------------------------------------------------------

class ZeroPPMixin:
    """qwZ, hpZ and qgZ on top of Stage3 (composed by zeroedu.compose.engine_class).

    It gives stage 3's coordinator a gather source (ZeroPPSource: where a unit's gather comes from) and overrides
    two hooks: reduce_scatter_buckets (qgZ's collective) and publish (hpZ's secondary copy goes stale)."""

    quantizer: BlockQuantizer = BlockQuantizer()   # qwZ's and qgZ's block quantizer (a subclass may set another)
    # hpZ's secondary partition is another copy of the parameters, which a broadcast into the shard would leave
    # stale; the flag covers every ZeRO++ engine, as the stage-3-only check it replaced did
    keeps_parameter_copies = True

    def setup(self) -> None:
        super().setup()
        zc = self.config.zero_optimization
        self.qwz, self.qgz = zc.zero_quantized_weights, zc.zero_quantized_gradients
        self.hpz = zc.zero_hpz_partition_size > 1
        self.node_size = self._node_size(zc.zero_hpz_partition_size)
        self.weight_bits, self.weight_block, self.grad_bits, self.grad_block = self._knobs()
        n, m = self.world_size, self.node_size
        # Every rank creates every group, in the same order; each keeps the two it belongs to.
        self.node_comm: Comm | None = None     # my node: ranks g*M .. g*M+M-1
        self.cross_comm: Comm | None = None    # my peers with the same local rank on every node
        if self.hpz or self.qgz:
            for g in range(n // m):
                self.node_comm = self.comm.subgroup(list(range(g * m, (g + 1) * m)), f"node{g}") or self.node_comm
            for local in range(m):
                self.cross_comm = self.comm.subgroup(list(range(local, n, m)), f"cross{local}") or self.cross_comm
        # hpZ's secondary shard: this rank's 1/M of every unit that is gathered (a persistent unit stays whole
        # and needs none), cut from the forward's all-gather. A unit is in secondary_fresh once a forward
        # gather has refreshed it after the last optimizer step (secondary_fresh).
        self._secondary_at: dict[int, int] = {}
        numel = 0
        for b in self.layout.buckets:
            if b.index not in self.persistent:
                self._secondary_at[b.index] = numel
                numel += b.padded // m
        self.secondary = torch.zeros(numel, dtype=self.dtype, device=self.param_shard.device) if self.hpz else None
        self.secondary_fresh: set[int] = set()
        self.units.source = ZeroPPSource(self)

    @staticmethod
    def _knobs() -> tuple[int, int, int, int]:
        """This engine's quantizer settings, read once from the module's knobs and checked."""
        knobs = {"WEIGHT_BITS": WEIGHT_BITS, "WEIGHT_BLOCK": WEIGHT_BLOCK, "GRAD_BITS": GRAD_BITS,
                 "GRAD_BLOCK": GRAD_BLOCK}
        for name, value in knobs.items():
            ok = value in (4, 8) if name.endswith("BITS") else (isinstance(value, int) and value >= 1)
            if not ok or isinstance(value, bool):
                want = "4 or 8" if name.endswith("BITS") else "a whole number of elements >= 1"
                raise ValueError(f"zeroedu.zeropp.{name} = {value!r}: it must be {want}. Set it before "
                                 f"initialize(), on every rank (inside the function that zeroedu.launch runs).")
        return WEIGHT_BITS, WEIGHT_BLOCK, GRAD_BITS, GRAD_BLOCK

    def _node_size(self, hpz: int) -> int:
        n = self.world_size
        size = hpz if hpz > 1 else NODE_SIZE or int(os.environ.get("LOCAL_WORLD_SIZE", n))
        if size < 1 or n % size:
            what = "zero_hpz_partition_size" if hpz > 1 else "zeroedu.zeropp.NODE_SIZE (or LOCAL_WORLD_SIZE)"
            raise ValueError(f"{what} = {size} must divide the world size {n}: ZeRO++ groups ranks into nodes "
                             f"of equal size. Pick a divisor of {n}.")
        return size

    def secondary_piece(self, b: Bucket) -> torch.Tensor:
        """This rank's 1/M of unit b in the secondary shard."""
        at = self._secondary_at[b.index]
        return self.secondary[at: at + b.padded // self.node_size]

    # -- parameters: qwZ and hpZ ------------------------------------------------------------------------------
    # Stage 3's coordinator decides when units are gathered; ZeRO++ only says how (ZeroPPSource below): from the
    # node's secondary copy (hpZ, in backward) or from every rank's primary piece (int8 blocks under qwZ).
    def gather_units(self, units: list[Bucket], bufs: list[torch.Tensor], from_node: bool) -> None:
        """On the comm thread: fill the units' buffers from the node's secondary copy or from the world."""
        if from_node:
            self.node_comm.all_gather_coalesced(bufs, [self.secondary_piece(b) for b in units], kind="params")
            return
        mine = [self.param_piece(b) for b in units]
        if self.qwz:
            self._quantized_all_gather(bufs, mine)
        else:
            self.comm.all_gather_coalesced(bufs, mine, kind="params")
        if self.hpz:
            for b, buf in zip(units, bufs, strict=True):
                self.secondary_piece(b).copy_(buf.view(self.node_size, -1)[self.node_comm.rank])

    def _quantized_all_gather(self, bufs: list[torch.Tensor], pieces: list[torch.Tensor]) -> None:
        """All-gather int8 blocks and their scales, every unit's in one message per rank; every rank decodes
        all of them (its own piece included, so that every rank computes with the same weights)."""
        payloads = [compress(p, self.weight_bits, self.weight_block, self.quantizer) for p in pieces]
        mine = torch.cat(payloads)
        rows = torch.empty(self.world_size, mine.numel(), dtype=torch.uint8, device=mine.device)
        self.comm.all_gather(rows.view(-1), mine, kind="params")
        start = 0
        for buf, piece, payload in zip(bufs, pieces, payloads, strict=True):
            arrived = rows[:, start: start + payload.numel()].contiguous()
            buf.copy_(decompress(arrived, piece.numel(), self.weight_bits, self.weight_block,
                                  self.quantizer).reshape(-1))
            start += payload.numel()

    # -- gradients: qgZ ---------------------------------------------------------------------------------------
    def reduce_scatter_buckets(self, bufs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """qgZ: the stage's gradient reduce-scatter as two quantized all-to-alls (quantized_reduce_scatter)."""
        if not self.qgz:
            super().reduce_scatter_buckets(bufs, outs)
            return
        for out, avg in zip(outs, self.quantized_reduce_scatter(bufs), strict=True):
            out.add_(avg.to(out.dtype))     # micro-steps accumulate in the shard

    def quantized_reduce_scatter(self, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """For each buffer, the average over ranks of this rank's piece of it (fp32), by two quantized
        all-to-alls that carry every buffer at once (each quantized in blocks of its own).

        Rank r = g*M + l (node g, local rank l) must end with piece r. Hop 1, inside node g: local rank l
        collects from every node peer the pieces {g'*M + l for every node g'} (the slices it will answer for
        across nodes) and sums them: node sums. Hop 2, across nodes among the ranks with local rank l: node g'
        gets the node sums of piece g'*M + l from every node and sums them. Reordering the pieces before hop 1
        is what makes the result land where a reduce-scatter would put it.
        """
        n, m = self.world_size, self.node_size
        g = n // m
        pieces = [buf.numel() // n for buf in bufs]
        by_dest = [buf.view(g, m, p).transpose(0, 1).reshape(m, g * p)           # row l': pieces g'*M + l'
                   for buf, p in zip(bufs, pieces, strict=True)]
        node_sums = self._exchange_and_sum(by_dest, self.node_comm)            # pieces g'*M + l, node-summed
        totals = self._exchange_and_sum([s.view(g, p) for s, p in zip(node_sums, pieces, strict=True)],
                                        self.cross_comm)
        return [t / n for t in totals]

    def _exchange_and_sum(self, rows: list[torch.Tensor], comm: Comm) -> list[torch.Tensor]:
        """Row j of each tensor goes to group rank j (quantized, all tensors in one all-to-all); returns, for
        each tensor, the fp32 sum of the rows that arrive."""
        if comm.world_size == 1:
            return [r[0].float() for r in rows]
        payloads = [compress(r, self.grad_bits, self.grad_block, self.quantizer) for r in rows]
        payload = torch.cat(payloads, dim=1)
        arrived = torch.empty_like(payload)
        comm.all_to_all(arrived.view(-1), payload.reshape(-1), kind="grads")
        out, start = [], 0
        for r, p in zip(rows, payloads, strict=True):
            width = p.shape[1]
            out.append(decompress(arrived[:, start: start + width].contiguous(), r.shape[-1], self.grad_bits,
                                  self.grad_block, self.quantizer).sum(dim=0))
            start += width
        return out

    # -- step and memory --------------------------------------------------------------------------------------
    def publish(self) -> None:
        super().publish()
        # New weights: the secondary copy is stale. Refreshing it here would be a cross-node all-gather (each
        # node holds only 1/G of the primary shards), the traffic hpZ exists to avoid; the next forward
        # all-gather brings the full units anyway and refreshes it for free.
        self.secondary_fresh.clear()

    def owned(self) -> dict[str, list[torch.Tensor]]:
        base = super().owned()
        if self.secondary is not None:   # hpZ's memory price: Psi/M more parameter elements per rank
            base["parameters"] = [*base["parameters"], self.secondary]
        return base


class ZeroPPSource(GatherSource):
    """How a ZeRO++ engine gathers units: in backward, a unit whose secondary copy is fresh comes from the node
    (hpZ); every other unit from the world, as int8 blocks under qwZ. Units from one source travel in one
    collective when the stage coalesces, as DeepSpeed's quantized all-gather does: each unit keeps its own blocks,
    so the bytes are exactly those of one collective per unit."""

    fusable = False   # qgZ replaces the reduce-scatter and hpZ gathers from the node: neither shares a round

    def plan(self, units: list[Bucket]) -> list[tuple[list[Bucket], Callable[[list, list[torch.Tensor]], None]]]:
        e = self.engine
        node_ok = e.hpz and e.comm.phase != "forward"
        from_node = [b for b in units if node_ok and b.index in e.secondary_fresh]
        from_world = [b for b in units if not (node_ok and b.index in e.secondary_fresh)]
        if e.hpz:   # the world gathers planned here refresh these before any later job reads them
            e.secondary_fresh.update(b.index for b in from_world)
        return [(from_node, partial(e.gather_units, from_node=True)),
                (from_world, partial(e.gather_units, from_node=False))]
