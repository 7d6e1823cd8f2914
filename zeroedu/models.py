"""The models the course trains, and deterministic synthetic data.

TinyGPT is a small decoder-only transformer whose output head shares its weight with the token embedding
(weight tying, as in GPT-2): the one parameter is used at the start and at the end of every forward, which
is exactly the case a ZeRO-3 implementation must get right. The MLP is the simplest model with several
layers. Quirky is tiny and puts every awkward case for a ZeRO engine in one model (the tests and the
exercise grader train it). All build the same weights on every rank from a seed, and the data is a function
of (seed, step), so every stage and every world size sees the same global batch.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Building a model seeds torch's global generator and draws its initial weights from it. Two threads that build
# models at once (`zeroedu grade --jobs 2` computes each notebook's single-process reference in a thread of its own)
# would interleave their draws, and one of them would get other weights than its seed says: an honest learner then
# fails "the gradients equal one process on the whole batch". So a construction holds this lock from its seed to
# its last draw.
_SEEDING = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int):
    """torch.manual_seed(seed), then the block's draws from the global generator, with no other thread drawing
    from it in between (other threads that build a model wait)."""
    with _SEEDING:
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 128
    seq_len: int = 32
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    # True: torch's scaled_dot_product_attention (a fused, flash-style kernel that keeps no s x s scores for
    # backward) instead of the explicit softmax(q k^T) v. Same function, other activation memory (notebook 11).
    fused_attention: bool = False
    # True: each block runs under zeroedu.checkpointing.checkpoint, which keeps only its input for backward.
    checkpoint_activations: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.fused = cfg.fused_attention
        # No bias: a key bias gets a gradient that is exactly zero in theory (softmax ignores a shift),
        # i.e. pure rounding noise that Adam would blow up into full-size steps.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # A buffer, not a parameter: ZeRO never partitions buffers.
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.fused:
            return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _whole(module: nn.Module):
    """Built inside zeroedu.zero.Init, a module's parameters are already partitioned (empty tensors) when its
    constructor returns, so an initialisation loop run afterwards would write into nothing and leave the
    default init in place. Gather the module's own parameters, change them on rank 0 and write its values back
    into every rank's pieces (GatheredParameters with modifier_rank=0, as DeepSpeed models do); every rank runs
    the same init, so the random state stays the same on all. One module at a time: never the whole model.
    Built normally, nothing is partitioned and this is a no-op."""
    params = list(module.parameters(recurse=False))
    if not any(getattr(p, "zero_partition", None) is not None for p in params):
        return contextlib.nullcontext()
    from zeroedu.zero import GatheredParameters

    return GatheredParameters(params, modifier_rank=0)


class TinyGPT(nn.Module):
    def __init__(self, cfg: TinyGPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        cfg = cfg or TinyGPTConfig()
        self.cfg = cfg
        with seeded(seed):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.head.weight = self.wte.weight  # tied: one Parameter, two modules
            for m in self.modules():
                if isinstance(m, nn.Linear | nn.Embedding):
                    with _whole(m):
                        nn.init.normal_(m.weight, std=0.02)
                        if isinstance(m, nn.Linear) and m.bias is not None:
                            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            if self.cfg.checkpoint_activations:
                from zeroedu.activation_checkpointing import checkpoint

                x = checkpoint(block, x)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (32, 64, 64, 10), seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the identity in forward; in backward each TP rank has part of the input's gradient, so sum."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, average=False, kind="tp")
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: sum the TP ranks' partial outputs in forward; the identity in backward."""

    @staticmethod
    def forward(ctx, y, comm):
        y = y.contiguous()
        comm.all_reduce(y, average=False, kind="tp")
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(nn.Module):
    """A transformer's MLP (Linear h->4h, GELU, Linear 4h->h) split over the ranks of `comm` as in Megatron-LM
    (Shoeybi et al. 2019): fc by its outputs (column parallel), out by its inputs (row parallel). Each rank
    computes 1/t of the hidden layer; one all-reduce in forward (and one in backward) completes the result, so
    every rank holds the same input and output: what activation partitioning (zeroedu.checkpointing) splits.
    Every rank builds the whole layer from the seed and keeps its slices, so t ranks compute what `full()`
    computes on one."""

    def __init__(self, d_model: int, comm=None, seed: int = 0) -> None:
        super().__init__()
        self.comm = comm
        rank, t = (comm.rank, comm.world_size) if comm is not None else (0, 1)
        if (4 * d_model) % t:
            raise ValueError(f"4 x d_model = {4 * d_model} hidden units do not split over {t} ranks")
        fc, out = self.full(d_model, seed)
        k = 4 * d_model // t
        self.fc = nn.Linear(d_model, k)
        self.out = nn.Linear(k, d_model, bias=rank == 0)   # the bias is added once, by rank 0's partial sum
        with torch.no_grad():
            self.fc.weight.copy_(fc.weight[rank * k: (rank + 1) * k])
            self.fc.bias.copy_(fc.bias[rank * k: (rank + 1) * k])
            self.out.weight.copy_(out.weight[:, rank * k: (rank + 1) * k])
            if rank == 0:
                self.out.bias.copy_(out.bias)

    @staticmethod
    def full(d_model: int, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
        """The whole layer's two Linears, as every rank builds them before slicing."""
        with seeded(seed):
            return nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is None or self.comm.world_size == 1:
            return self.out(F.gelu(self.fc(x)))
        y = self.out(F.gelu(self.fc(_CopyToTensorParallel.apply(x, self.comm))))
        return _ReduceFromTensorParallel.apply(y, self.comm)


class Quirky(nn.Module):
    """Every awkward case in one small model: a tied weight (embedding and head), a layer used twice in one
    forward, a layer that never gets a gradient, a buffer, and parameter counts no world size divides."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with seeded(seed):
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


def quirky_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quirky's global batch of one step: 5 tokens per sample, the target a fixed function of each token."""
    g = torch.Generator().manual_seed(7_919 + step)
    x = torch.randint(0, 13, (batch, 5), generator=g)
    return x, (x * 3 + 1) % 13


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), targets)


def gpt_batch(step: int, batch: int, cfg: TinyGPTConfig | None = None, seed: int = 1234):
    """The global batch of one step: token sequences that follow a simple learnable rule, plus noise."""
    cfg = cfg or TinyGPTConfig()
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def mlp_batch(step: int, batch: int, sizes: tuple[int, ...] = (32, 64, 64, 10), seed: int = 1234):
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(batch, sizes[0], generator=g)
    y = (x[:, : sizes[-1]].argmax(dim=1) + step) % sizes[-1]
    return x, y


def shard_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, micro: int = 0,
                accum: int = 1):
    """Rank `rank`'s part of micro-step `micro`: the global batch is split into accum x world_size slices."""
    n = x.shape[0] // (accum * world_size)
    i = (micro * world_size + rank) * n
    return x[i: i + n], y[i: i + n]
