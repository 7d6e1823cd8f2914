"""What DeepSpeed's logging keys print, made from zeroedu's own measurements.

- `steps_per_print` K: every K optimizer steps, rank 0 prints the step, skipped steps, lr, momentum, this rank's
  loss and the loss scale (DeepSpeed prints the first four; the loss and scale are what a learner looks for).
- `wall_clock_breakdown`: after each optimizer step, the forward, backward and step time of that step (summed over
  its micro-steps), from the engine's timeline: the same phases the ledger files collectives under.
- `memory_breakdown`: after each optimizer step, the meter's bytes by category on this rank (engine.memory()).
- `comms_logger`: with `verbose`, every collective of the step as it is in the ledger; `engine.log_summary()`
  prints the totals per collective and message size, as `deepspeed.comm.log_summary()` does.

Times are this machine's: on CPU ranks, gloo's, never NCCL's. The report holds absolute positions into the
timeline and the ledger (StepReport), so their trimming in a long run never shifts what a step reports.
"""

from __future__ import annotations

from collections import defaultdict

from zeroedu.fmt import fmt_bytes
from zeroedu.memory import CATEGORIES

TIMELINE_KEEP = 5_000   # phases (and printed lines) kept: thousands of steps for plots; a long run's memory stays flat


class Timeline(list):
    """A list that keeps the newest `keep` to 2 x `keep` items (the engine's phases, its printed lines) and counts
    every item ever appended, so a position can be held as an absolute count that trimming does not shift.

    `keep` is the public knob: set it on the class before a run (every timeline made afterwards) or on one
    timeline (`engine.timeline.keep = 100`). It trims in chunks, so appending stays amortized O(1).
    """

    keep: int = TIMELINE_KEEP
    appended: int = 0          # items ever appended (the absolute position of the next one)

    def append(self, item) -> None:
        super().append(item)
        self.appended += 1
        if len(self) > 2 * self.keep:
            del self[:-self.keep]

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def __reduce__(self):   # unpickled as it was: not re-appended (and re-trimmed) before its attributes are set
        return _rebuild_timeline, (list(self), self.__dict__)


def _rebuild_timeline(items: list, state: dict) -> Timeline:
    timeline = Timeline()
    list.extend(timeline, items)
    timeline.__dict__.update(state)
    return timeline


def since(entries: list, start: int, end: int) -> tuple[list, int]:
    """The entries from absolute position `start` on, in a bounded list whose next absolute position is `end`;
    and how many of them were already trimmed away (0 unless one step outgrew the list's window)."""
    first = len(entries) - (end - start)
    return entries[max(first, 0):], max(-first, 0)


def ledger_end(ledger) -> int:
    """The ledger's next absolute position: the entries it let go plus the ones it keeps."""
    return ledger.dropped + len(ledger)


class StepReport:
    """What the logging keys print after each optimizer step (the engine calls after_step()).

    It owns where the previous step ended in the engine's timeline and ledger, as absolute positions (items
    appended since the start). Both lists keep a bounded window and trim their oldest items in chunks; a position
    taken as a list index would shift at each trim, and the report would read the wrong slice (an empty one:
    zeros, or one that starts past the step: collectives missing).
    """

    def __init__(self, timeline: Timeline, ledger) -> None:
        self.timeline_at = timeline.appended
        self.ledger_at = ledger_end(ledger)

    def after_step(self, engine) -> None:
        cfg, step = engine.config, engine.global_step
        phases, lost_phases = since(engine.timeline, self.timeline_at, engine.timeline.appended)
        entries, lost_entries = since(engine.ledger, self.ledger_at, ledger_end(engine.ledger))
        self.timeline_at, self.ledger_at = engine.timeline.appended, ledger_end(engine.ledger)
        if cfg.steps_per_print and step % cfg.steps_per_print == 0:
            loss = "n/a" if engine.last_loss is None else f"{engine.last_loss:.4f}"
            engine.log(f"step={step}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                       f"mom={engine.get_mom()}, loss={loss} (rank {engine.rank}), "
                       f"loss_scale={engine.scaler.scale:g}")
        if cfg.wall_clock_breakdown:
            ms: dict[str, float] = defaultdict(float)
            for phase, t0, t1 in phases:
                ms[phase] += (t1 - t0) * 1e3
            engine.log(f"step={step} time (ms) | fwd: {ms['forward']:.2f} | bwd: {ms['backward']:.2f} | "
                       f"step: {ms['step']:.2f}"
                       + (f" | ({lost_phases} phases of this step trimmed before this report: raise "
                          f"engine.timeline.keep)" if lost_phases else ""))
        if cfg.memory_breakdown:
            resident = engine.memory()["resident"]
            parts = " | ".join(f"{c}: {resident[c]:,}" for c in CATEGORIES if resident.get(c))
            engine.log(f"step={step} memory (bytes, rank {engine.rank}) | {parts}")
        cl = cfg.comms_logger
        if cl.enabled and cl.verbose:
            if lost_entries:
                engine.log(f"step={step}: {lost_entries} collectives of this step were trimmed from the ledger "
                           "before this report: raise engine.ledger.max_entries")
            for e in entries:
                if e.op == "skipped_step" or not (cl.prof_all or e.op in cl.prof_ops):
                    continue
                engine.log(f"comm op: {e.op} | phase: {e.phase} | kind: {e.kind} | "
                           f"time (ms): {e.seconds * 1e3:.3f} | msg size: {fmt_bytes(e.tensor_bytes, 'B')} | "
                           f"sent: {fmt_bytes(e.sent_bytes, 'B')} | impl: {e.impl}")


def comms_summary(ledger) -> str:
    """Per collective and message size: count, bytes sent by this rank, total and mean time."""
    rows: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for e in ledger:
        if e.op == "skipped_step":
            continue
        r = rows[(e.op, e.tensor_bytes)]
        r[0] += 1
        r[1] += e.sent_bytes
        r[2] += e.seconds * 1e3
    lines = [f"{'comm op':<16}{'message size (B)':>18}{'count':>8}{'sent (B)':>16}{'total (ms)':>13}"
             f"{'avg (ms)':>11}"]
    for (op, size), (count, sent, total) in sorted(rows.items()):
        lines.append(f"{op:<16}{size:>18,}{int(count):>8}{int(sent):>16,}{total:>13.2f}{total / count:>11.3f}")
    return "\n".join(lines)
