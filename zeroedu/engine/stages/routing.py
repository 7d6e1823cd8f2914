"""Stage 3: ranks whose modules run differently are stopped before a gather pairs different units.

Why: at stage 3 a module's parameters are all-gathered when it runs (and again for its backward). When the modules
that run differ between ranks (a mixture of experts routes tokens by their data, a branch depends on the batch, a
module runs on some ranks only), rank 0 gathers one unit while rank 1 gathers another in the same collective: equal
sizes are exchanged without a word (each rank then computes with pieces of two different modules), unequal ones make
gloo abort with its own text. Neither names the module, and the fix is DeepSpeed's: mark the module that holds the
routed ones as a leaf (`set_z3_leaf_modules`), so it is gathered whole, on every rank, whenever it runs.

How: before each gather starts, every rank sends which units it is about to gather, for which module call, from
which line, on the agreement group (zeroedu.comm.agreement: one small message, started asynchronously on the main
thread, read on the comm thread just before the gather itself). Ranks that disagree raise `RoutingDriftError`
there, naming each rank's modules and the class to mark as a leaf, and the gather never starts.

When: that message and its wait cost about 8 % of a TinyGPT step, so the ranks ask only while it can matter
(`Agreement.watch_gathers`): in the first steps, until every rank is known to have run its first step's modules
in the same order, and from then on only once some rank's forward has left the order its first forward recorded.
A model whose modules always run in order (every model without routing) stops asking after its third step. Every
gather's units still go into the per-step check's record, so ranks that part later, at a step where nobody asks,
are stopped at that step's check, naming the step (equal sizes), or by gloo's abort, which the launcher reports
with each rank's last collectives (unequal ones).
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable

import torch

from zeroedu.comm.agreement import GATHER_OF, CollectiveDriftError, caller_line

ENTERED = 16   # module names sent with each gather's question: where the routing parted, for the suggested leaf
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)   # no forward of their own: hooks on them never run


class RoutingDriftError(CollectiveDriftError):
    """At stage 3, the ranks were about to gather different units: their modules ran differently."""


class RoutingCheck:
    """One stage-3 engine's check, before each gather, that every rank gathers the same units."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.now: tuple[str, torch.nn.Module | None] = ("forward", None)   # the hook that is gathering, and its module
        self.count = 0          # gathers asked about since the engine was built
        self.entered: deque[str] = deque(maxlen=ENTERED)   # the newest modules this forward entered, by name
        self._names: dict[torch.nn.Module, str] | None = None

    def name(self, m: torch.nn.Module | None) -> str:
        if self._names is None:
            self._names = {m: n or "the model" for n, m in self.engine.module.named_modules()}
        return self._names.get(m, type(m).__name__) if m is not None else ""

    def enter(self, m: torch.nn.Module, call: int, departed: bool = False) -> None:
        """Module m starts its forward as this forward's call number `call` (0: a new forward); `departed`: this
        forward has left the module order the first one recorded."""
        agreement = self.engine.comm.agreement
        if departed and agreement is not None:
            agreement.departed = True
        if call == 0:
            self.entered.clear()
            if self.engine.comm.agreement is not None:   # the engine call that runs this forward's gathers
                self.engine.comm.agreement.where = caller_line()
        self.entered.append(self.name(m))
        self.now = ("forward", m)

    def ask(self, part: list) -> Callable[[], None]:
        """Send which units this gather is for; return the check to run before the gather (on the comm thread)."""
        agreement = self.engine.comm.agreement
        if agreement is None or agreement.group is None:   # one rank, or no agreement check: nothing to compare
            return lambda: None
        units = [b.index for b in part]
        mods = self.engine.unit_modules
        # Which modules' units, in the step's record, in the order the comm thread gathers them (it runs what this
        # returns just before the gather): two equal-size gathers of different units tell the step's check apart.
        sig = f"{GATHER_OF}{', '.join(self.name(mods[u]) for u in units)}"
        if not agreement.watch_gathers:
            return lambda: agreement.note(sig)
        self.count += 1
        why, m = self.now
        # Compared: a CRC of the units (the lists of names may be shortened to fit the message), and their size.
        mine = {"gather": self.count, "key": zlib.crc32(repr(units).encode()), "numel": sum(b.numel for b in part),
                "modules": [self.name(mods[b.index]) for b in part],
                "for": f"{why} of {self.name(m)}" if m is not None else why, "at": caller_line(),
                "entered": list(self.entered)}
        answers = agreement.ask(mine)

        def check() -> None:
            agreement.note(sig)
            got = answers()
            if len({(g.get("key"), g.get("numel")) for g in got}) > 1:
                raise RoutingDriftError(routing_message(got, list(agreement.ranks), self.engine.module))
        return check


def _describe(g: dict) -> str:
    if "gather" not in g:   # its message on the agreement group was its optimizer step's check
        return (f"no gather: it had finished its forward and backward and called engine.step() at "
                f"{g.get('where') or 'an unknown line'} (optimizer step {g.get('step')})")
    at = f", called from {g['at']}" if g.get("at") else ""
    return (f"gather #{g['gather']}: {', '.join(g.get('modules', []))} ({g.get('numel')} elements) for the "
            f"{g.get('for')}{at}")


def leaf_suggestion(model: torch.nn.Module, got: list[dict]) -> str:
    """Which class to mark as a leaf: the innermost module (with a forward of its own, not the model itself) around a
    differing module inside which every rank ran something in this forward. There the ranks' routing parted: the
    previous gather still agreed, so it parted among the modules entered since."""
    modules = dict(model.named_modules())
    names = sorted({n for g in got for n in g.get("modules", []) if n in modules and n})
    ran = [set(g.get("entered", [])) | set(g.get("modules", [])) for g in got]
    for name in names:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            outer = ".".join(parts[:k])
            if isinstance(modules[outer], CONTAINERS):   # a container runs no hooks: it cannot be a leaf
                continue
            if all(any(n.startswith(outer + ".") for n in r) for r in ran):
                cls = type(modules[outer]).__name__
                return (f"Here: zeroedu.zero.set_z3_leaf_modules(model, [{cls}]) before zeroedu.initialize(), {cls} "
                        f"being the class of `{outer}`, inside which the ranks ran different modules.")
    return (f"The differing modules ({', '.join(names)}) have no common parent module other than the model itself: "
            f"move them into a module of their own whose forward chooses among them (as a mixture-of-experts layer "
            f"does), then mark that class: zeroedu.zero.set_z3_leaf_modules(model, [ThatClass]) before "
            f"zeroedu.initialize().")


def routing_message(got: list[dict], ranks: list[int], model: torch.nn.Module) -> str:
    lines = "\n".join(f"  rank {r}: {_describe(g)}" for r, g in zip(ranks, got, strict=True))
    return ("stage 3: the ranks were about to gather different parameters in the same collective, because the "
            "modules that run differ between ranks (data-dependent routing as in a mixture of experts, a branch "
            "that depends on the batch, or a module used on some ranks only). Stopped before that gather: gloo "
            "would have exchanged pieces of different modules (equal sizes, without a word) or aborted (unequal "
            "ones).\n" + lines + "\n"
            "At stage 3 each module's parameters are gathered when it runs, so every rank must run the same modules "
            "in the same order. Mark the module that holds the routed ones as a stage-3 leaf, as DeepSpeed does "
            "(deepspeed.utils.set_z3_leaf_modules): it is then gathered whole whenever it runs, on every rank, and "
            "a parameter inside it that got no gradient on a rank counts as zero. The leaf must run on every rank "
            "and its input must require grad. " + leaf_suggestion(model, got))
