"""The ledger: every collective and every copy a rank runs, one entry each, with per-step sums that stay bounded."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch


@dataclass(slots=True)
class LedgerEntry:
    op: str
    phase: str
    kind: str
    step: int
    dtype: str
    numel: int
    group: tuple[int, ...]
    group_size: int
    tensor_bytes: int        # bytes of the full tensor (all-reduce: the tensor; rs: the input; ag: the output)
    sent_bytes: int          # bytes this rank sent (measured for "ring", ring volume for "native")
    sent_measured: bool
    impl: str
    seconds: float           # wall time of the call on this rank (gloo: the collective; NCCL: enqueuing it)
    seq: int
    start: float = 0.0       # time.time() when it started, for per-rank timelines


class Ledger(list):
    """The collectives of one rank, in order: a list of LedgerEntry with summaries, bounded for long runs.

    A run appends about 8 entries a step (more at stage 3), and a list of all of them grows by about 4 KB a step:
    gigabytes over a million steps. So the ledger keeps two things:
    - per-step aggregates (calls, tensor bytes, sent bytes by kind, phase and op) for the newest `max_steps`
      steps, and running totals since the start: `per_step()` and `totals()` read these, never the raw list;
    - the raw entries themselves (this list) for the newest `max_entries` only: `select()`, `by()`, `sent()`,
      `rows()` and iteration see those.
    Both limits are plenty for the course's runs (a few steps). None keeps everything, for a run that needs every
    entry: `engine.ledger.max_entries = None` before training, or `Ledger.max_entries = None` for every ledger
    made afterwards. `dropped` counts the raw entries let go.
    """

    max_entries: int | None = 10_000
    max_steps: int | None = 1_000

    def __init__(self, entries=(), max_entries: int | None = ..., max_steps: int | None = ...) -> None:
        super().__init__()
        if max_entries is not ...:
            self.max_entries = max_entries
        if max_steps is not ...:
            self.max_steps = max_steps
        self.dropped = 0
        self._kept_from: int | None = None   # aggregates of steps below this were let go
        self._steps: dict[int, dict[tuple[str, str, str], list[int]]] = {}   # step -> (kind, phase, op) -> sums
        self._totals: dict[tuple[str, str, str], list[int]] = {}
        self.extend(entries)

    def __reduce__(self):   # list subclasses unpickle their items before their attributes: say how instead
        return rebuild_ledger, (list(self), self.__dict__)

    # -- recording --
    def append(self, e: LedgerEntry) -> None:
        key = (e.kind, e.phase, e.op)
        for sums in (self._steps.setdefault(e.step, {}).setdefault(key, [0, 0, 0]),
                     self._totals.setdefault(key, [0, 0, 0])):
            sums[0] += 1
            sums[1] += e.tensor_bytes
            sums[2] += e.sent_bytes
        if self.max_steps is not None and len(self._steps) > self.max_steps:
            for old in sorted(self._steps)[: len(self._steps) - self.max_steps]:
                del self._steps[old]
                self._kept_from = max(old + 1, self._kept_from or 0)
        super().append(e)
        limit = self.max_entries
        if limit is not None and len(self) > limit + max(1, limit // 8):   # trim in batches: amortized O(1)
            cut = len(self) - limit
            del self[:cut]
            self.dropped += cut

    def note(self, op: str, phase: str, kind: str, step: int, tensor: torch.Tensor | list[torch.Tensor] | None, *,
             group: tuple[int, ...], sent_bytes: int, impl: str, sent_measured: bool = True, seconds: float = 0.0,
             seq: int = -1, start: float | None = None, dtype: torch.dtype | None = None) -> LedgerEntry:
        """Record one entry: `tensor` gives its dtype, numel and tensor_bytes (a list: their sums, as for a coalesced
        collective; None: a record without a tensor, as a skipped step); `dtype` overrides the dtype recorded (a
        collective records its output's); `start` defaults to now. Returns the entry appended."""
        tensors = [] if tensor is None else tensor if isinstance(tensor, list) else [tensor]
        dtype = dtype or (tensors[0].dtype if tensors else None)
        entry = LedgerEntry(
            op=op, phase=phase, kind=kind, step=step,
            dtype="-" if dtype is None else str(dtype).removeprefix("torch."),
            numel=sum(t.numel() for t in tensors), group=group, group_size=len(group),
            tensor_bytes=sum(t.numel() * t.element_size() for t in tensors),
            sent_bytes=int(sent_bytes), sent_measured=sent_measured, impl=impl, seconds=seconds, seq=seq,
            start=time.time() if start is None else start)
        self.append(entry)
        return entry

    def extend(self, entries) -> None:
        for e in entries:
            self.append(e)

    def __iadd__(self, entries):
        self.extend(entries)
        return self

    # -- summaries --
    def rows(self) -> list[dict]:
        return [asdict(e) for e in self]

    def select(self, **match) -> Ledger:
        return Ledger((e for e in self if all(getattr(e, k) == v for k, v in match.items())),
                      max_entries=None, max_steps=None)

    def sent(self, **match) -> int:
        return sum(e.sent_bytes for e in self.select(**match))

    def by(self, *keys: str, field: str = "sent_bytes", **match) -> dict:
        """Sum of `field` grouped by the given keys, e.g. by("phase", "op", step=3)."""
        out: dict = defaultdict(int)
        for e in self.select(**match):
            k = tuple(getattr(e, key) for key in keys)
            out[k[0] if len(k) == 1 else k] += getattr(e, field)
        return dict(out)

    def steps(self) -> list[int]:
        """The steps whose aggregates are kept (the newest max_steps)."""
        return sorted(self._steps)

    def per_step(self, step: int, kinds: tuple[str, ...] = ("params", "grads"), field: str = "sent_bytes"
                 ) -> dict[str, int]:
        """Bytes sent in one optimizer step as "phase/op" -> bytes (the keys zeroedu.theory uses); `field`
        "tensor_bytes" or "calls" for those instead. From the per-step aggregates: no scan of the entries."""
        if self._kept_from is not None and step < self._kept_from:
            raise KeyError(f"step {step} is older than the {len(self._steps)} steps this ledger keeps "
                           f"({min(self._steps)} to {max(self._steps)}); set ledger.max_steps (None: all) before "
                           "the run to keep more")
        return _by_phase_op(self._steps.get(step, {}), kinds, field)

    def totals(self, kinds: tuple[str, ...] = ("params", "grads"), field: str = "sent_bytes") -> dict[str, int]:
        """per_step's sums over every step since the ledger started, however many entries were let go."""
        return _by_phase_op(self._totals, kinds, field)


_FIELDS = {"calls": 0, "tensor_bytes": 1, "sent_bytes": 2}


def _by_phase_op(sums: dict[tuple[str, str, str], list[int]], kinds: tuple[str, ...], field: str) -> dict[str, int]:
    if field not in _FIELDS:
        raise ValueError(f"field must be one of {', '.join(_FIELDS)}, got {field!r}")
    out: dict[str, int] = defaultdict(int)
    for (kind, phase, op), values in sums.items():
        if kind in kinds:
            out[f"{phase}/{op}"] += values[_FIELDS[field]]
    out = dict(out)
    out["total"] = sum(out.values())
    return out


def rebuild_ledger(entries: list, state: dict) -> Ledger:
    ledger = Ledger(max_entries=None, max_steps=None)
    list.extend(ledger, entries)
    ledger.__dict__.update(state)
    return ledger


_rebuild_ledger = rebuild_ledger   # ledgers pickled before it was public name it so
