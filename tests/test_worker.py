"""The one asynchronous mechanism (zeroedu/comm/worker.py): lanes run their jobs in order, a Handle hands back what a
job
raised, and everything an engine starts is in Engine.in_flight until wait() drains it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zeroedu
from zeroedu.comm.worker import worker


def test_a_lane_runs_jobs_in_submission_order_on_its_own_thread():
    seen, threads = [], set()

    def job(i: int) -> None:
        time.sleep(0.002 * (5 - i))   # the earlier jobs are the slower ones: order is the lane's, not the clock's
        seen.append(i)
        threads.add(threading.current_thread().name)

    handles = [worker().submit(lambda i=i: job(i), lane="io") for i in range(5)]
    for h in reversed(handles):
        h.wait()
    assert seen == [0, 1, 2, 3, 4] and threads == {"zeroedu-io"}


def test_a_handle_raises_what_its_job_raised():
    h = worker().submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        h.wait()


def test_an_unknown_lane_is_refused_with_the_lanes_there_are():
    with pytest.raises(ValueError, match="no lane 'gpu'.*comm, io"):
        worker().submit(lambda: None, lane="gpu")


def test_wait_drains_everything_the_engine_started():
    engine, *_ = zeroedu.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0}})
    done = []
    engine.submit(lambda: (time.sleep(0.05), done.append("io")), lane="io")
    engine.submit(lambda: (time.sleep(0.05), done.append("comm")))
    assert len(engine.in_flight) == 2
    engine.wait()
    assert sorted(done) == ["comm", "io"] and not engine.in_flight
    for _ in range(2):   # stage 3's prefetches and overlapped reduce-scatters go through the same set
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        assert not engine.in_flight        # backward returns with nothing in flight
        engine.step()
        assert not engine.in_flight


def test_forwards_without_a_backward_keep_in_flight_bounded():
    """Evaluation runs forwards only, so nothing calls wait(): the prefetches it starts must not pile up."""
    engine, *_ = zeroedu.initialize(model=torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4))), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 1000}})
    engine.backward(engine(torch.randn(2, 4)).sum())   # the first forward records the order prefetch follows
    engine.step()
    with torch.no_grad():
        for _ in range(200):
            engine(torch.randn(2, 4))
    assert 0 < len(engine.in_flight) <= 256


# Where each asynchronous thing may start, in the training path (comm/, engine/, checkpoint/): threads only as the
# worker's lanes; CUDA streams and events only in offload's side-stream file, the seam its docstring explains; a
# torch.distributed collective with async_op=True only where it becomes a Handle (comm/collectives.py, called by
# Comm._run) or, known and shrink-only, in the agreement check, whose few works it settles itself each step.
ASYNC_STARTS = {
    r"threading\.Thread\(|ThreadPoolExecutor|concurrent\.futures": {"comm/worker.py"},
    r"torch\.cuda\.(Stream|Event)\(": {"engine/extras/offload/transfers.py"},
    r"async_op=True|async_op=async_op": {"comm/collectives.py", "comm/agreement.py"},
}


def test_the_worker_and_offloads_cuda_stream_are_the_only_async_mechanisms():
    import re
    from pathlib import Path

    root = Path(zeroedu.__file__).parent
    files = [p for d in ("comm", "engine", "checkpoint") for p in (root / d).rglob("*.py")]
    assert len(files) > 20, files
    for pattern, allowed in ASYNC_STARTS.items():
        found = {p.relative_to(root).as_posix() for p in files if re.search(pattern, p.read_text())}
        assert found == allowed, (pattern, sorted(found))
