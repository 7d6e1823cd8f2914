"""A small model of a caching allocator, to see memory fragmentation (ZeRO-R's M_D) without a GPU.

A GPU allocator such as PyTorch's CUDA caching allocator takes large regions from the device and cuts blocks
from them; a freed block is kept for reuse and merges with free neighbours. Tensors with different lifetimes
(checkpoints that live until backward, activations that die at once) leave a region a patchwork: there can be
more free bytes than a request needs and still no free block large enough, and the request fails: out of
memory with memory free. ZeRO-R's memory defragmentation (M_D) gives long-lived tensors (checkpoints,
gradients) space of their own, allocated once, so the short-lived ones never interleave with them.

This model keeps one region as a sorted list of blocks, rounds requests up to 512 bytes (the CUDA allocator's
granularity) and takes the smallest free block that fits (best fit). It leaves out streams, the small and
large pools and giving memory back to the device. On a GPU, torch.cuda.memory_stats() reports the real
thing: "allocated_bytes.all.current", "reserved_bytes.all.current", "inactive_split_bytes.all.current" (free
bytes trapped in split blocks); torch.cuda.memory_snapshot() lists every block.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUND = 512


@dataclass
class Block:
    start: int
    size: int
    owner: str | None = None     # None: free


class Arena:
    """`capacity` bytes of device memory, handed out by best fit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks = [Block(0, capacity)]

    @staticmethod
    def rounded(nbytes: int) -> int:
        return max(ROUND, -(-nbytes // ROUND) * ROUND)

    def malloc(self, nbytes: int, owner: str) -> int:
        """The start of a new block for `owner`; MemoryError when no free block is large enough."""
        size = self.rounded(nbytes)
        free = [b for b in self.blocks if b.owner is None and b.size >= size]
        if not free:
            raise MemoryError(f"cannot allocate {size:,} bytes for {owner}: {self.free_bytes():,} bytes are free "
                              f"but the largest free block is {self.largest_free():,} bytes (fragmentation)")
        b = min(free, key=lambda b: (b.size, b.start))
        i = self.blocks.index(b)
        if b.size > size:            # split: the rest stays free
            self.blocks.insert(i + 1, Block(b.start + size, b.size - size))
        self.blocks[i] = Block(b.start, size, owner)
        return b.start

    def free(self, owner: str) -> None:
        """Free every block of `owner` and merge free neighbours."""
        if not any(b.owner == owner for b in self.blocks):
            raise KeyError(f"no block belongs to {owner!r}")
        for b in self.blocks:
            if b.owner == owner:
                b.owner = None
        merged: list[Block] = []
        for b in self.blocks:
            if merged and merged[-1].owner is None and b.owner is None:
                merged[-1].size += b.size
            else:
                merged.append(b)
        self.blocks = merged

    def free_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.owner is None)

    def largest_free(self) -> int:
        return max((b.size for b in self.blocks if b.owner is None), default=0)

    def stats(self) -> dict[str, int | float]:
        """Allocated and free bytes, the largest free block, and fragmentation = 1 - largest free / free."""
        free = self.free_bytes()
        return {"allocated": self.capacity - free, "free": free, "largest_free": self.largest_free(),
                "fragmentation": 1 - self.largest_free() / free if free else 0.0}

    def layout(self, width: int = 64) -> str:
        """The region as a line of characters: '.' free, else the owner's first letter."""
        out = []
        for i in range(width):
            at = i * self.capacity // width
            b = next(b for b in self.blocks if b.start <= at < b.start + b.size)
            out.append("." if b.owner is None else b.owner[0])
        return "".join(out)


def forward_pattern(arena: Arena, layers: int, checkpoint_bytes: int, activation_bytes: int,
                    contiguous: bool) -> None:
    """A checkpointed forward: per layer, activations that die when the layer ends and a checkpoint (the next
    layer's input, made while they are alive) that lives until backward. contiguous=True puts all checkpoints
    in one buffer allocated first (ZeRO-R's M_D, DeepSpeed's contiguous_memory_optimization)."""
    if contiguous:
        arena.malloc(layers * checkpoint_bytes, "checkpoints")
    for i in range(layers):
        arena.malloc(activation_bytes, f"activations {i}")
        if not contiguous:
            arena.malloc(checkpoint_bytes, f"checkpoint {i}")
        arena.free(f"activations {i}")
