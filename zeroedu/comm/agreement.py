"""Collective agreement: the ranks check, once per optimizer step, that they ran the same collectives.

Why: two ranks that call different collectives of the same size and dtype (rank 1 skipped `engine.step()`, so
its gradient reduce-scatter meets rank 0's parameter all-gather) exchange the wrong tensors without any error,
and every step after that is wrong. gloo cannot see it: it only moves bytes.

How: every collective of a Comm adds its signature (op, dtype, size, phase, kind, bucket) to a running CRC of
what this rank ran since the last check. At each optimizer step, each rank sends that CRC, its collective
count, its step and backward counts and the line that called `engine.step()`, in one small all-gather on a
process group of its own, so that the check is never paired with a data collective. The all-gather is started
asynchronously and read at a later step, once it has completed (at most two steps later: then a step waits for
it), so it costs one small message a step and, normally, no wait. When the ranks disagree, each raises
`CollectiveDriftError`, which names the ranks whose sequence differs from the others' (the odd ones out), the
step where the drift began, and each rank's collectives and call line.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import Counter, deque

import torch
import torch.distributed as dist

PAYLOAD_BYTES = 2048        # bytes each rank sends per check: a JSON summary, zero-padded
_SHOWN = 12            # signatures kept per interval, for the message (the CRC covers all of them)
_RECENT = 4            # the newest signatures, shown by the launcher when gloo aborts on a mismatch
IN_FLIGHT = 2         # checks started and not yet read; at this many, the next step waits for the oldest


class CollectiveDriftError(RuntimeError):
    """The ranks ran different collectives between two optimizer steps."""


def caller_line() -> str:
    """The first line outside torch and zeroedu on this thread's stack ("train.py:12"), or "" if none."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".", 1)[0] not in ("torch", "zeroedu", "contextlib"):
            name = frame.f_code.co_filename.rsplit("/", 1)[-1]
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class Agreement:
    """The running record of one Comm's collectives, and the per-step check against the other ranks."""

    def __init__(self, ranks: tuple[int, ...], group: dist.ProcessGroup | None, watcher: object = None) -> None:
        self.ranks = ranks
        self.group = group       # a group of its own (None: a world of one, nothing to check)
        self.crc = 0
        self.count = 0
        self.shown: list[str] = []
        self.backwards = 0       # engine.backward() calls since the last check
        self.unfinished = 0      # ... of which raised part-way and training went on (the exception was caught)
        self.unfinished_at: int | None = None   # the first optimizer step where one did (never reset)
        self.in_backward = False
        self.accum = 1           # ... and how many a step should have (gradient_accumulation_steps)
        self.where = ""          # the line that called the engine's current backward() or step()
        self.checks = 0
        self.recent: deque[tuple[int, str]] = deque(maxlen=_RECENT)
        self._pending: deque[tuple] = deque()   # (work, outputs) of the checks in flight, oldest first
        # watcher: the collectives' observer (zeroedu.comm.observe); inside launch() the launcher's rank context
        if watcher is not None and hasattr(watcher, "agreement"):   # inside launch(): the launcher's rank context,
            watcher.agreement = self.record                         # whose status slot the parent reads

    def record(self) -> dict:
        """What this rank ran since its last check, for the launcher's error when gloo aborts."""
        return {"c": self.checks, "n": self.count, "b": self.backwards, "u": self.unfinished_at, "acc": self.accum,
                "w": self.where,
                "r": list(self.recent)}

    def note(self, sig: str) -> None:
        """One collective entered, in this rank's order."""
        self.crc = zlib.crc32(sig.encode(), self.crc)
        self.count += 1
        self.recent.append((self.count, sig))
        if len(self.shown) < _SHOWN:
            self.shown.append(sig)

    def check(self, step: int, where: str) -> None:
        """Called by every rank at each optimizer step: read the previous check, start this one."""
        if self.group is None:
            return
        self.settle(wait=len(self._pending) >= IN_FLIGHT)
        self.where = where
        self.checks += 1
        summary = {"check": self.checks, "step": step, "n": self.count, "crc": self.crc,
                   "backwards": self.backwards, "unfinished": self.unfinished, "where": where, "sigs": self.shown}
        data = json.dumps(summary, separators=(",", ":")).encode()[:PAYLOAD_BYTES]
        mine = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty_like(mine) for _ in self.ranks]
        # torch's own all_gather, not launch()'s watched one: this group is not part of the collective order the
        # launcher compares, and this check must never be counted (or reported) as one of the run's collectives.
        gather = getattr(dist.all_gather, "__wrapped__", dist.all_gather)
        work = gather(outs, mine, group=self.group, async_op=True)
        self._pending.append((work, outs))
        self.crc, self.count, self.shown, self.backwards, self.unfinished = 0, 0, [], 0, 0
        self.recent.clear()

    def settle(self, wait: bool = True) -> None:
        """Read the checks in flight that have completed (wait: the oldest one even if it has not yet), and raise
        CollectiveDriftError if the ranks disagree. Not waiting keeps a rank that is a moment ahead from waiting
        for the others' check: it reads it at a later step."""
        while self._pending and (wait or self._pending[0][0].is_completed()):
            work, outs = self._pending.popleft()
            work.wait()
            wait = False
            got = [json.loads(bytes(t.numpy()).rstrip(b"\0") or b"{}") for t in outs]
            if len({(g.get("n"), g.get("crc")) for g in got}) > 1:
                self._pending.clear()
                raise CollectiveDriftError(drift_message(got, list(self.ranks)))


UNFINISHED = ("An engine.backward() raised part-way (an exception in autograd or a backward hook) and the "
              "exception was caught and training went on: that rank skipped the rest of that backward's collectives "
              "while the others ran them. Let the exception end the run, or raise it on every rank.")


def drift_message(got: list[dict], ranks: list[int]) -> str:
    """Say which ranks differ from the others, from when, and what each ran."""
    votes = Counter((g.get("n"), g.get("crc")) for g in got)
    top = votes.most_common()
    broken = [r for r, g in zip(ranks, got, strict=True) if g.get("unfinished")]
    if broken and len(broken) < len(ranks):
        odd = broken
    elif len(top) > 1 and top[0][1] == top[1][1]:   # no majority (two ranks): name whoever called backward() more
        # or less often than step() allows, else every rank
        odd = [r for r, g in zip(ranks, got, strict=True) if g.get("backwards") != min(x.get("backwards", 0)
                                                                                        for x in got)]
        odd = odd or ranks
    else:
        odd = [r for r, g in zip(ranks, got, strict=True) if (g.get("n"), g.get("crc")) != top[0][0]]
    first = got[0]
    lines = []
    for r, g in zip(ranks, got, strict=True):
        sigs = "; ".join(g.get("sigs", []))
        more = g.get("n", 0) - len(g.get("sigs", []))
        lines.append(f"  rank {r}{' (differs)' if r in odd else ''}: optimizer step {g.get('step')} called at "
                     f"{g.get('where') or 'an unknown line'}; since the previous step it ran {g.get('backwards')} "
                     f"backward(){f' ({u} raised part-way)' if (u := g.get('unfinished')) else ''} and "
                     f"{g.get('n')} collectives: {sigs}{f' (+{more} more)' if more > 0 else ''}")
    backs = {g.get("backwards") for g in got}
    hint = (UNFINISHED if broken else
            "The ranks called engine.backward() a different number of times between optimizer steps: a rank "
            "skipped engine.step() (or called it more often). Every rank must call backward() and step() the same "
            "number of times." if len(backs) > 1 else
            "Every rank must run the same collectives in the same order: the same model code path with the same "
            "parameters getting gradients, the same engine calls, and no exception swallowed half-way through a "
            "backward.")
    return (f"collective drift: rank(s) {', '.join(map(str, odd))} ran a different sequence of collectives "
            f"from the other ranks between optimizer steps {first.get('step', 1) - 1} and {first.get('step')} "
            f"(check #{first.get('check')}); gloo matched them by size alone, so tensors went to the wrong places. "
            f"Stopped here instead of training on.\n" + "\n".join(lines) + "\n" + hint)
