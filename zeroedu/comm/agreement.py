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
from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroedu.memory import untracked

PAYLOAD_BYTES = 2048        # bytes each rank sends per check: a JSON summary, zero-padded
_SHOWN = 12            # signatures kept per interval, for the message (the CRC covers all of them)
_RECENT = 4            # the newest signatures, shown by the launcher when gloo aborts on a mismatch
IN_FLIGHT = 2         # checks started and not yet read; at this many, the next step waits for the oldest


GATHER_OF = "stage-3 gather of "   # how a stage-3 gather's units appear in the record (engine.stages.routing)
ROUTING_HINT = ("The ranks parted at a stage-3 gather: their modules ran differently (data-dependent routing as in "
                "a mixture of experts, a branch that depends on the batch, a module used on some ranks only), so "
                "they gathered different modules' parameters. Mark the module that holds the routed ones as a stage-3 "
                "leaf, as DeepSpeed does: zeroedu.zero.set_z3_leaf_modules(model, [ThatClass]) before "
                "zeroedu.initialize() (deepspeed.utils.set_z3_leaf_modules in DeepSpeed); it is then gathered whole "
                "whenever it runs, on every rank.")


class CollectiveDriftError(RuntimeError):
    """The ranks ran different collectives between two optimizer steps."""


# This process's agreements with checks left to read, oldest first (strong references: an engine is often gone
# when fn returns, and its last checks still have to be read). finish() takes one off; its next check puts it back.
_LIVE: list[Agreement] = []


def finish_all(why: str) -> None:
    """Finish every agreement of this process with checks left to read, oldest first (a launched rank, once fn has
    returned): the checks of the run's last steps are read, so a drift there is raised instead of ending the run
    in silence."""
    if not dist.is_initialized():   # fn destroyed the process group itself: nothing can be checked any more
        _LIVE.clear()
    while _LIVE:
        _LIVE[0].finish(why)


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
        self.step = 0            # the optimizer step of the newest check
        self.recent: deque[tuple[int, str]] = deque(maxlen=_RECENT)
        self._pending: deque[tuple] = deque()   # (work, outputs) of the checks in flight, oldest first
        # Stage 3's check before each gather (zeroedu.engine.stages.routing) costs a message and a wait per gather,
        # so it runs only while it can matter: until every rank is known to have run its first step's modules
        # in order, and for good once any rank's forward has left the order its first forward recorded (the
        # routing changed). The ranks decide it alike: from the checks that every rank has read for certain.
        self.departed = False                      # this rank left its recorded module order since the last check
        self.first_departure: int | None = None    # the first check at which some rank had (from the checks read)
        self.watch_gathers = True
        # watcher: the collectives' observer (zeroedu.comm.observe); inside launch() the launcher's rank context
        if group is not None:
            _LIVE.append(self)
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
        # Shown with the line of the engine call that ran it (the CRC leaves it out: ranks may call from different
        # lines and still agree).
        shown = f"{sig} @ {self.where}" if self.where else sig
        self.recent.append((self.count, shown))
        if len(self.shown) < _SHOWN:
            self.shown.append(shown)

    def check(self, step: int, where: str, final: str = "") -> None:
        """Called by every rank at each optimizer step: read the previous check, start this one. `final`: not a step
        but the end of what the run checks (finish())."""
        if self.group is None:
            return
        self.settle(wait=len(self._pending) >= IN_FLIGHT)
        # Every rank has now read every check up to number `known` (the reads are oldest first, and at most
        # IN_FLIGHT - 1 stay unread), so deciding from those alone gives every rank the same answer.
        known = self.checks + 1 - IN_FLIGHT
        self.watch_gathers = known < 1 or (self.first_departure is not None and self.first_departure <= known)
        if not final and self not in _LIVE:   # finished before (a checkpoint save), and checked again since
            _LIVE.append(self)
        self.where = where
        self.checks += 1
        self.step = step
        summary = {"check": self.checks, "step": step, "n": self.count, "crc": self.crc,
                   "backwards": self.backwards, "unfinished": self.unfinished, "acc": self.accum, "where": where,
                   "sigs": self.shown, "departed": self.departed}
        if final:
            summary["final"] = final
        self._pending.append(self._send(summary))
        self.crc, self.count, self.shown, self.backwards, self.unfinished = 0, 0, [], 0, 0
        self.departed = False
        self.recent.clear()

    def _send(self, payload: dict) -> tuple:
        """Start an all-gather of `payload` (JSON, zero-padded to PAYLOAD_BYTES) over the group; (work, outputs).
        Every message on the group has that one size, so two ranks that send different kinds of message (one a
        step's check, the other a stage-3 gather's) read each other's instead of making gloo abort."""
        data = _encode(payload)
        with untracked():   # not the training's memory: a measured peak must not depend on when the answers come
            mine = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            outs = [torch.empty_like(mine) for _ in self.ranks]
            # torch's own all_gather, not launch()'s watched one: this group is not part of the collective order
            # the launcher compares, and this check must never be counted (or reported) as one of the run's
            # collectives.
            gather = getattr(dist.all_gather, "__wrapped__", dist.all_gather)
            return gather(outs, mine, group=self.group, async_op=True), outs

    def ask(self, payload: dict) -> Callable[[], list[dict]]:
        """Start sending `payload` to every rank now, in this rank's order of messages on the group, and return the
        function that waits for the answers: every rank's payload, in rank order. Stage 3 asks before each gather
        (which units?), so that ranks about to gather different units find out before the gather starts."""
        work, outs = self._send(payload)

        def answers() -> list[dict]:
            work.wait()
            return [_decode(t) for t in outs]
        return answers

    def finish(self, why: str) -> None:
        """Check what ran since the last optimizer step, then read every check still in flight: a drift in the run's
        last steps is raised here, before the run ends (launch(), at fn's return) or a checkpoint is saved, instead
        of never. Every rank must call it at the same point (both places are)."""
        if self.group is None:
            return
        if self in _LIVE:
            _LIVE.remove(self)
        self.check(self.step, caller_line() or self.where, final=why)
        while self._pending:
            self.settle(wait=True)

    def settle(self, wait: bool = True) -> None:
        """Read the checks in flight that have completed (wait: the oldest one even if it has not yet), and raise
        CollectiveDriftError if the ranks disagree. Not waiting keeps a rank that is a moment ahead from waiting
        for the others' check: it reads it at a later step."""
        while self._pending and (wait or self._pending[0][0].is_completed()):
            work, outs = self._pending.popleft()
            work.wait()
            wait = False
            got = [_decode(t) for t in outs]
            if len({(g.get("n"), g.get("crc")) for g in got}) > 1:
                self._pending.clear()
                raise CollectiveDriftError(drift_message(got, list(self.ranks)))
            if self.first_departure is None and any(g.get("departed") for g in got):
                self.first_departure = got[0].get("check")


def _encode(payload: dict) -> bytes:
    """The payload as JSON of at most PAYLOAD_BYTES: what does not fit goes from its lists (the shown signatures,
    module names: the message shows fewer of them), never from the fields compared."""
    payload = dict(payload)
    while len(data := json.dumps(payload, separators=(",", ":")).encode()) > PAYLOAD_BYTES:
        lists = [k for k, v in payload.items() if isinstance(v, list) and v]
        if not lists:   # nothing left to shorten: strings only (a very long call line)
            payload = {k: v[:64] if isinstance(v, str) else v for k, v in payload.items()}
            continue
        longest = max(lists, key=lambda k: len(json.dumps(payload[k])))
        payload[longest] = payload[longest][:-1]
    return data


def _decode(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.numpy()).rstrip(b"\0") or b"{}")


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
        # or less often than a step has (gradient_accumulation_steps), else every rank; parting() shows where
        odd = [r for r, g in zip(ranks, got, strict=True) if "gather" in g or g.get("backwards") != g.get("acc", 1)]
        odd = odd if 0 < len(odd) < len(ranks) else ranks
    else:
        odd = [r for r, g in zip(ranks, got, strict=True) if (g.get("n"), g.get("crc")) != top[0][0]]
    first = got[0]
    lines = []
    for r, g in zip(ranks, got, strict=True):
        if "gather" in g:   # its message on the group was a stage-3 gather's question (zeroedu.engine.stages.routing)
            lines.append(f"  rank {r}{' (differs)' if r in odd else ''}: not at an optimizer step: it was about to "
                         f"gather {', '.join(g.get('modules', []))} for the {g.get('for')}"
                         f"{f' (called from {at})' if (at := g.get('at')) else ''}")
            continue
        sigs = "; ".join(g.get("sigs", []))
        more = g.get("n", 0) - len(g.get("sigs", []))
        at = (f"{g['final']}, after optimizer step {g.get('step')}, at" if g.get("final") else
              f"optimizer step {g.get('step')} called at")
        lines.append(f"  rank {r}{' (differs)' if r in odd else ''}: {at} "
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
    when = (f"after optimizer step {first.get('step')}, found at {first['final']}" if all(g.get("final") for g in got)
            else f"between optimizer steps {first.get('step', 1) - 1} and {first.get('step')}")
    lines.append(parted := parting(got, ranks))
    if GATHER_OF in parted:
        hint = ROUTING_HINT
    return (f"collective drift: rank(s) {', '.join(map(str, odd))} ran a different sequence of collectives "
            f"from the other ranks {when} (check #{first.get('check')}); gloo matched them by size alone, so "
            f"tensors went to the wrong places. "
            f"Stopped here instead of training on.\n" + "\n".join(filter(None, lines)) + "\n" + hint)


def parting(got: list[dict], ranks: list[int]) -> str:
    """Where the ranks' collectives since the previous check first differ: what each rank called there, and from
    which line (the engine call that ran it). "" if the shown ones agree (the drift lies past them)."""
    seqs = [[sig for sig in g.get("sigs", [])] if "gather" not in g else None for g in got]
    if any(seq is None for seq in seqs):
        return ""
    bare = [[sig.split(" @ ", 1)[0] for sig in seq] for seq in seqs]
    for i in range(max(map(len, seqs))):
        if any(i >= len(seq) and g.get("n", 0) > len(seq) for seq, g in zip(seqs, got, strict=True)):
            return ""   # a rank's list was cut here: what it ran next is not in its message
        here = {b[i] if i < len(b) else None for b in bare}
        if len(here) > 1:
            what = "; ".join(f"rank {r} called {seq[i].replace(' @ ', ' from ')}" if i < len(seq) else
                             f"rank {r} called no more collectives before its check (at "
                             f"{g.get('where') or 'an unknown line'})"
                             for r, seq, g in zip(ranks, seqs, got, strict=True))
            return f"  They part at collective #{i + 1} since the previous check: {what}."
    return ""
