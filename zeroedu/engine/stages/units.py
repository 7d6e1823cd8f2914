"""Stage 3's bookkeeping, kept out of stage3.py: a unit's state, and the order the forward ran modules in."""

from __future__ import annotations

import enum

import torch


class UnitState(enum.Enum):
    """Where a unit is in its life, as FSDP2's sharded / unsharded states."""
    RELEASED = "released"     # only this rank's piece, in the shard; the parameters are empty tensors
    GATHERING = "gathering"   # an all-gather into the unit's buffer is on its way (in `inflight`)
    GATHERED = "gathered"     # whole: the parameters are views of its buffer (in `gathered`)


class ForwardTrace:
    """The order in which modules ran in the first forward, and whether the running forward follows it."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []   # module calls, in the first forward's order
        self.last_use: dict[int, int] = {}         # unit -> the last call of the forward that needs it
        self.recording = True                      # the first forward is running
        self.follows = False                       # this forward runs as recorded: release and prefetch by it
        self.open: list[int] = []                  # calls entered and not yet left (nested modules)
        self.calls = 0                             # calls entered in this forward

    def enter(self, m: torch.nn.Module) -> int:
        """Module m starts; returns its call number in this forward."""
        i = self.calls
        self.calls += 1
        self.open.append(i)
        if self.recording:
            self.modules.append(m)
        elif self.follows and (i >= len(self.modules) or self.modules[i] is not m):
            self.follows = False   # this forward runs differently: release only at the end, prefetch no more
        return i

    def leave(self) -> int:
        """The innermost running module is done; returns its call number."""
        return self.open.pop()

    def end(self, units_of: dict[torch.nn.Module, list[int]]) -> None:
        """The whole forward is done. After the first, its record becomes the order to follow."""
        if self.recording:
            self.recording, self.follows = False, True
            for j, m in enumerate(self.modules):
                for u in units_of[m]:
                    self.last_use[u] = j
        self.calls = 0
