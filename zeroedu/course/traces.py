"""Traces in the profiler's format: every phase and collective of every rank, opened in chrome://tracing or Perfetto.

`instrument(engine)` makes the engine's phases (forward, each stage-3 unit's forward, backward, each bucket's
reduction, the optimizer step, the publishing all-gathers) and every collective its Comm runs into
`torch.profiler.record_function` ranges. torch's profiler records them next to the aten operators and
`export_chrome_trace` writes the trace: nothing here writes a trace event by hand. A collective's range is named

    zeroedu/<phase>/<op>/<what> <kind> <dtype>[<numel>] <bytes> B     e.g. zeroedu/backward/reduce_scatter/bucket3 ...

where <what> is the bucket (stages 0-2), the unit (stage 3's gathers) or "publish" the collective was started for,
and the figures are the ledger's own (the full tensor, as LedgerEntry.tensor_bytes). One range per ledger entry.

`trace_run(config, world_size)` trains a course config on N ranks under the profiler (zeroedu.launch), merges the
ranks' exported traces into one file (one process per rank, named "rank r") and reports, per rank and step, the
communication time nothing else overlapped (`exposed_comm`).

Collectives run on the comm thread when overlap_comm is set: the profiler is started with profile_all_threads so
that thread's ranges are recorded too. A native collective started asynchronously (gloo's all-reduce at stages 0-1
with overlap) is recorded while it is enqueued only; the ranks' blocking collectives and the "direct"/"ring" ones
are recorded for as long as they run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

PREFIX = "zeroedu"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
_NAME = re.compile(r"^zeroedu/(?P<phase>[^/]+)/(?P<op>[a-z_]+)/(?P<what>\S*) (?P<kind>\S+) (?P<dtype>\w+)"
                   r"\[(?P<numel>\d+)\] (?P<bytes>\d+) B$")
_local = threading.local()


# -- labels: which bucket or unit a collective serves, carried to the thread that runs it ----------------------
def _label() -> str:
    stack = getattr(_local, "labels", None)
    return stack[-1] if stack else "-"


@contextmanager
def _labelled(label: str) -> Iterator[None]:
    stack = _local.__dict__.setdefault("labels", [])
    stack.append(label)
    try:
        yield
    finally:
        stack.pop()


def _carry(fn: Callable[[], None]) -> Callable[[], None]:
    """fn, run later on another thread under the label that is current now."""
    label = _label()

    def job() -> None:
        with _labelled(label):
            fn()
    return job


def _instrument_worker() -> None:
    """Jobs handed to the comm thread keep the label of the code that handed them over (once per process)."""
    from zeroedu.comm.thread import worker

    w = worker()
    if getattr(w, "_zeroedu_traced", False):
        return
    submit, run = w.submit, w.run
    w.submit = lambda fn, *args, **kw: submit(_carry(fn), *args, **kw)   # (newer workers take a lane too)
    w.run = lambda fn, *args, **kw: run(_carry(fn), *args, **kw)
    w._zeroedu_traced = True


def collective_name(op: str, phase: str, a, b, kind: str, bucket: int | None = None) -> str:
    """The range name of one collective: what the ledger records for it (full tensor, output dtype). `bucket`:
    the bucket the Comm says it runs for (Comm.for_bucket, where the Comm has it), if no label says more."""
    full = b if op == "reduce_scatter" else a
    tensors = full if isinstance(full, list) else [full]
    outs = a if isinstance(a, list) else [a]
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dtype = str(outs[0].dtype).removeprefix("torch.")
    label = _label()
    if label == "-" and bucket is not None:
        label = f"bucket{bucket}"
    return f"{PREFIX}/{phase}/{op}/{label} {kind} {dtype}[{numel}] {nbytes} B"


def instrument_comm(comm) -> None:
    """Every collective of this Comm (and of the subgroups it makes later) in a record_function range."""
    if getattr(comm, "_zeroedu_traced", False):
        return
    call, together, subgroup = comm._call, comm._call_together, comm.subgroup

    def traced_call(op, a, b, kind, phase, step, *args, **kw):
        with record_function(collective_name(op, phase, a, b, kind, kw.get("bucket"))):
            return call(op, a, b, kind, phase, step, *args, **kw)

    def traced_together(calls, phase, step, *args, **kw):
        # one round for all of them; one range each (nested, same span), as the ledger has one entry each
        bucket = args[0] if args else kw.get("bucket")
        with ExitStack() as stack:
            for op, outs, ins, kind, _ in calls:
                stack.enter_context(record_function(collective_name(op, phase, outs, ins, kind, bucket)))
            return together(calls, phase, step, *args, **kw)

    def traced_subgroup(*args, **kw):
        sub = subgroup(*args, **kw)
        if sub is not None:
            instrument_comm(sub)
        return sub

    comm._call, comm._call_together, comm.subgroup = traced_call, traced_together, traced_subgroup
    comm._zeroedu_traced = True


def _ranged(name: Callable[..., str], fn: Callable, label: Callable[..., str] | None = None) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        with record_function(name(*args, **kw)):
            if label is None:
                return fn(*args, **kw)
            with _labelled(label(*args, **kw)):
                return fn(*args, **kw)
    return wrapper


def instrument(engine):
    """Make `engine`'s phases and collectives profiler ranges (this engine only; returns it). Idempotent."""
    if getattr(engine, "_zeroedu_traced", False):
        return engine
    _instrument_worker()
    instrument_comm(engine.comm)
    phase = lambda: engine.comm.phase  # noqa: E731
    engine.backward = _ranged(lambda *a, **k: f"{PREFIX}/backward", engine.backward)
    engine.step = _ranged(lambda *a, **k: f"{PREFIX}/step", engine.step)
    engine.reduce_bucket = _ranged(lambda b: f"{PREFIX}/{phase()}/reduce/bucket{b.index}", engine.reduce_bucket,
                                   lambda b: f"bucket{b.index}")
    engine.publish = _ranged(lambda: f"{PREFIX}/step/publish", engine.publish, lambda: "publish")
    # stage 3: one label per gathered group of units (on the engine, or on its unit coordinator)
    owner = engine if hasattr(engine, "start_gathers") else getattr(engine, "units", None)
    if owner is not None and hasattr(owner, "start_gathers"):
        owner.start_gathers = _ranged(
            lambda units: f"{PREFIX}/{phase()}/gather/unit" + "+".join(str(b.index) for b in units),
            owner.start_gathers, lambda units: "unit" + "+".join(str(b.index) for b in units))
    # forward: module hooks (engine(x) is the class's __call__); at stage 3, one range per unit inside it
    _range_hooks(engine.module, f"{PREFIX}/forward")
    for k, m in enumerate(getattr(engine, "unit_modules", [])):
        if m is not engine.module:
            _range_hooks(m, f"{PREFIX}/forward/unit{k}")
    engine._zeroedu_traced = True
    return engine


def _range_hooks(module: torch.nn.Module, name: str) -> None:
    """A record_function range from this module's forward pre-hook (first) to its forward hook (last)."""
    open_ranges: list = []

    def pre(m, args):
        r = record_function(name)
        r.__enter__()
        open_ranges.append(r)

    def post(m, args, out):
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre, prepend=True)
    module.register_forward_hook(post, always_call=True)


# -- running a config under the profiler ----------------------------------------------------------------------
def profiler():
    """torch's CPU profiler, recording every thread (the comm thread's collectives too)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities,
                   experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))


def profile_rank(rank: int, world_size: int, config: Mapping, steps: int = 2, global_batch: int = 8,
                 model_cfg=None) -> dict:
    """For zeroedu.launch: train `steps` steps of the course's TinyGPT under the profiler; return this rank's
    exported trace and the ledger entries of the profiled steps (as dicts)."""
    import zeroedu
    from zeroedu.course.basics import build_model, one_step

    engine, *_ = zeroedu.initialize(model=build_model(model_cfg), config=dict(config))
    instrument(engine)
    first = len(engine.ledger)
    with profiler() as prof:
        for step in range(steps):
            with record_function(f"{PREFIX}/train_step{step}"):
                one_step(engine, step, global_batch, model_cfg, rank, world_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return {"rank": rank, "trace": trace, "ledger": engine.ledger.rows()[first:]}


def merge_traces(traces: Mapping[int, Mapping]) -> dict:
    """One Chrome trace from the ranks' exported traces: each rank's events under pid = rank (named "rank r"),
    and each zeroedu collective's figures (op, kind, dtype, numel, bytes) in its args, read off its name."""
    events: list[dict] = []
    for rank, trace in sorted(traces.items()):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for e in trace["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            e = dict(e, pid=rank)
            m = _NAME.match(e.get("name", ""))
            if m:
                e["args"] = {**e.get("args", {}), "op": m["op"], "phase": m["phase"], "for": m["what"],
                             "kind": m["kind"], "dtype": m["dtype"], "numel": int(m["numel"]),
                             "bytes": int(m["bytes"])}
            events.append(e)
    first = next(iter(traces.values()), {})
    return {k: v for k, v in first.items() if k != "traceEvents"} | {"traceEvents": events}


def collective_events(trace: Mapping, rank: int | None = None) -> list[dict]:
    """The zeroedu collective ranges of a (merged) trace, in start order (of one rank, if given)."""
    out = [e for e in trace["traceEvents"] if e.get("ph") == "X" and _NAME.match(e.get("name", ""))
           and (rank is None or e["pid"] == rank)]
    return sorted(out, key=lambda e: e["ts"])


# -- exposed communication ------------------------------------------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def exposed_comm(trace: Mapping, rank: int) -> list[dict]:
    """Per profiled step of one rank: its wall time, the time some collective ran ("comm"), and the part of
    that no computation overlapped ("exposed"), in microseconds. Computation: the aten operators of the
    training thread that are not part of a collective; a collective's time is its range, on any thread."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") == rank]
    steps = sorted((e for e in evs if re.fullmatch(rf"{PREFIX}/train_step\d+", e["name"])), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no {PREFIX}/train_stepN range for rank {rank}: trace a run made by profile_rank")
    main_tid = steps[0]["tid"]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in evs if _NAME.match(e["name"])]
    comm_u = _union(comm)
    main_comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in evs
                        if _NAME.match(e["name"]) and e["tid"] == main_tid])
    ops = [(e["ts"], e["ts"] + e["dur"]) for e in evs if e.get("cat") == "cpu_op" and e["tid"] == main_tid]
    # an operator inside a collective on the training thread is the collective's work, not overlap
    compute = [iv for iv in _union(ops) if not _intersect([iv], main_comm)]
    out = []
    for e in steps:
        window = [(e["ts"], e["ts"] + e["dur"])]
        c = _intersect(comm_u, window)
        hidden = _intersect(c, _union(compute))
        out.append({"step": int(e["name"].removeprefix(f"{PREFIX}/train_step")), "wall_us": e["dur"],
                    "comm_us": _length(c), "exposed_us": _length(c) - _length(hidden)})
    return out


@dataclass
class TraceRun:
    """What trace_run measured: the merged trace (written to `path`), each rank's ledger entries of the traced
    steps, and each rank's per-step exposed communication (exposed_comm)."""

    path: str
    trace: dict
    ledgers: dict[int, list[dict]]
    exposed: dict[int, list[dict]] = field(default_factory=dict)


def trace_run(config: Mapping, world_size: int = 2, path: str = "zeroedu_trace.json", steps: int = 2,
              global_batch: int = 8, model_cfg=None, **launch_kw) -> TraceRun:
    """Train `config` on world_size ranks under torch's profiler; write the merged Chrome trace to `path`
    (open it in chrome://tracing or https://ui.perfetto.dev)."""
    import zeroedu

    results = zeroedu.launch(profile_rank, world_size=world_size, args=(dict(config), steps, global_batch,
                                                                        model_cfg), **launch_kw)
    merged = merge_traces({r["rank"]: r["trace"] for r in results})
    with open(path, "w") as f:
        json.dump(merged, f)
    return TraceRun(path, merged, {r["rank"]: r["ledger"] for r in results},
                    {r["rank"]: exposed_comm(merged, r["rank"]) for r in results})
