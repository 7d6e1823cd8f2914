"""What DeepSpeed's logging keys print, made from zeroedu's own measurements.

- `steps_per_print` K: every K optimizer steps, rank 0 prints the step, skipped steps, lr, momentum, this rank's
  loss and the loss scale (DeepSpeed prints the first four; the loss and scale are what a learner looks for).
- `wall_clock_breakdown`: after each optimizer step, the forward, backward and step time of that step (summed over
  its micro-steps), from the engine's timeline: the same phases the ledger files collectives under.
- `memory_breakdown`: after each optimizer step, the meter's bytes by category on this rank (engine.memory()).
- `comms_logger`: with `verbose`, every collective of the step as it is in the ledger; `engine.log_summary()`
  prints the totals per collective and message size, as `deepspeed.comm.log_summary()` does.

Times are this machine's: on CPU ranks, gloo's, never NCCL's.
"""

from __future__ import annotations

from collections import defaultdict

from zeroedu.fmt import fmt_bytes
from zeroedu.memory import CATEGORIES


def after_step(engine) -> None:
    cfg = engine.config
    timeline_mark, ledger_mark = engine._marks
    engine._marks = (len(engine.timeline), len(engine.ledger))
    step = engine.global_step
    if cfg.steps_per_print and step % cfg.steps_per_print == 0:
        loss = "n/a" if engine.last_loss is None else f"{engine.last_loss:.4f}"
        engine.log(f"step={step}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, mom={engine.get_mom()}, "
                   f"loss={loss} (rank {engine.rank}), loss_scale={engine.scaler.scale:g}")
    if cfg.wall_clock_breakdown:
        ms: dict[str, float] = defaultdict(float)
        for phase, t0, t1 in engine.timeline[timeline_mark:]:
            ms[phase] += (t1 - t0) * 1e3
        engine.log(f"step={step} time (ms) | fwd: {ms['forward']:.2f} | bwd: {ms['backward']:.2f} | "
                   f"step: {ms['step']:.2f}")
    if cfg.memory_breakdown:
        resident = engine.memory()["resident"]
        parts = " | ".join(f"{c}: {resident[c]:,}" for c in CATEGORIES if resident.get(c))
        engine.log(f"step={step} memory (bytes, rank {engine.rank}) | {parts}")
    cl = cfg.comms_logger
    if cl.enabled and cl.verbose:
        for e in engine.ledger[ledger_mark:]:
            if e.op == "skipped_step" or not (cl.prof_all or e.op in cl.prof_ops):
                continue
            engine.log(f"comm op: {e.op} | phase: {e.phase} | kind: {e.kind} | time (ms): {e.seconds * 1e3:.3f} | "
                       f"msg size: {fmt_bytes(e.tensor_bytes, 'B')} | sent: {fmt_bytes(e.sent_bytes, 'B')} | "
                       f"impl: {e.impl}")


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
