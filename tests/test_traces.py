"""zeroedu.course.traces: 2 gloo ranks trained under torch's own profiler; the Chrome trace it exports, merged,
holds one range per collective of each rank's ledger, nested inside the phase that ran it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from zeroedu import course
from zeroedu.course import traces

pytestmark = pytest.mark.timeout(300)

CONFIGS = {2: course.ds_config(2, "bf16", world_size=2),
           # threshold 0: no unit stays whole, so the forward gathers every unit (one range each)
           3: course.ds_config(3, "bf16", world_size=2, stage3_param_persistence_threshold=0)}


@pytest.fixture(scope="module", params=[2, 3])
def run(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / f"stage{request.param}.json"
    return request.param, traces.trace_run(CONFIGS[request.param], world_size=2, path=str(path), steps=2)


def _spans(trace, pid, pattern):
    import re

    return [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e["pid"] == pid and re.fullmatch(pattern, e["name"])]


def _inside(span, spans, slack=1.0):
    return any(s - slack <= span[0] and span[1] <= e + slack for s, e in spans)


def test_the_written_file_is_a_chrome_trace_with_one_process_per_rank(run):
    _, r = run
    with open(r.path) as f:
        trace = json.load(f)                                # what chrome://tracing and Perfetto read
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    # torch's profiler recorded the aten operators too, on the same timeline
    assert any(e.get("cat") == "cpu_op" and e["name"].startswith("aten::") for e in trace["traceEvents"])


def test_one_collective_range_per_ledger_entry(run):
    stage, r = run
    for rank in (0, 1):
        events = traces.collective_events(r.trace, rank)
        ledger = [e for e in r.ledgers[rank] if e["op"] in traces.COLLECTIVES]
        assert ledger, "the profiled steps ran collectives"
        key = lambda op, phase, kind, dtype, numel, nbytes: (op, phase, kind, dtype, numel, nbytes)  # noqa: E731
        got = Counter(key(e["args"]["op"], e["args"]["phase"], e["args"]["kind"], e["args"]["dtype"],
                          e["args"]["numel"], e["args"]["bytes"]) for e in events)
        want = Counter(key(e["op"], e["phase"], e["kind"], e["dtype"], e["numel"], e["tensor_bytes"]) for e in ledger)
        assert got == want
        # in the order the ledger numbered them (one Comm here: seq is the order of entry)
        assert [e["args"]["op"] for e in events] == [e["op"] for e in sorted(ledger, key=lambda e: e["seq"])]
        ops = Counter(e["op"] for e in ledger)
        assert ops["reduce_scatter"] > 0 and ops["all_gather"] > 0
        if stage == 3:   # the forward gathers units, each range says which
            fwd = [e for e in events if e["args"]["phase"] == "forward"]
            assert fwd and all(e["args"]["op"] == "all_gather" and e["args"]["for"].startswith("unit")
                               for e in fwd)
        else:            # each reduce-scatter names the bucket it reduced
            assert all(e["args"]["for"].startswith("bucket") for e in events if e["args"]["op"] == "reduce_scatter")


def test_phases_nest(run):
    stage, r = run
    for rank in (0, 1):
        steps = _spans(r.trace, rank, r"zeroedu/train_step\d+")
        assert len(steps) == 2
        phases = {p: _spans(r.trace, rank, f"zeroedu/{p}") for p in ("forward", "backward", "step")}
        for p, spans in phases.items():
            assert len(spans) == 2, p                          # one per step (no accumulation here)
            assert all(_inside(s, steps) for s in spans)
        for e in traces.collective_events(r.trace, rank):     # a collective runs inside the phase that asked for it
            span = (e["ts"], e["ts"] + e["dur"])
            assert _inside(span, phases[e["args"]["phase"]]), e["name"]
        assert all(_inside(s, phases["backward"]) for s in _spans(r.trace, rank, r"zeroedu/backward/reduce/bucket\d+"))
        units = _spans(r.trace, rank, r"zeroedu/forward/unit\d+")
        assert bool(units) == (stage == 3) and all(_inside(s, phases["forward"]) for s in units)


def test_exposed_communication_is_part_of_the_step(run):
    _, r = run
    for rank in (0, 1):
        rows = r.exposed[rank]
        assert [row["step"] for row in rows] == [0, 1]
        for row in rows:
            assert 0 < row["comm_us"] <= row["wall_us"]
            assert 0 <= row["exposed_us"] <= row["comm_us"]


def test_exposed_comm_needs_a_profiled_run():
    with pytest.raises(ValueError, match="train_stepN"):
        traces.exposed_comm({"traceEvents": []}, 0)
