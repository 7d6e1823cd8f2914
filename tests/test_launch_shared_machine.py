"""launch() on a shared machine (JupyterHub, a lab server): what a rank creates, only its user can open or run
(issue 36, item 8 and 7). Real ranks, real files."""

from __future__ import annotations

import os
import stat
import sys

import cloudpickle
import pytest
import torch.distributed as dist

from zeroedu.launch import launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _what_a_rank_sees(rank: int, world_size: int) -> dict:
    out_file = os.path.realpath("/proc/self/fd/1")   # launch() points the rank's stdout at rank<N>.stdout
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):         # PrefixStore(s) around the one the ranks met through
        store = store.underlying_store
    return {"stdout": out_file, "stdout_mode": stat.S_IMODE(os.stat(out_file).st_mode),
            "stderr_mode": stat.S_IMODE(os.stat(os.path.realpath("/proc/self/fd/2")).st_mode),
            "folder_mode": stat.S_IMODE(os.stat(os.path.dirname(out_file)).st_mode),
            "store": type(store).__name__}


def test_rank_logs_are_not_executable_and_the_rendezvous_is_a_private_file():
    for rank, seen in enumerate(launch(_what_a_rank_sees, 2)):
        assert seen["stdout"].endswith(f"rank{rank}.stdout"), seen
        assert seen["stdout_mode"] == 0o644 and seen["stderr_mode"] == 0o644, seen
        # Ranks meet through a file in a folder only this user can open, not a TCP store any local user can join.
        assert seen["store"] == "FileStore" and seen["folder_mode"] == 0o700, seen


def _batchnorm(rank: int, world_size: int) -> dict:
    import torch

    import zeroedu

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    engine, *_ = zeroedu.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1}})
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank)) + rank   # each rank its own data
    engine.backward(engine(x).square().mean())
    engine.step()
    return {"note": [x for x in engine.log_lines if "running statistics" in x], "mean": model[1].running_mean}


def test_batchnorm_statistics_that_drift_between_ranks_are_noted():
    """Like DeepSpeed 0.19.8 (runtime/engine.py _broadcast_model: parameters, once, never buffers), the engine
    does not sync running statistics; the note says so on every rank. The drift itself is measured here."""
    results = launch(_batchnorm, 2)
    assert all(len(r["note"]) == 1 and "as in DeepSpeed, nothing syncs them" in r["note"][0] for r in results)
    assert not results[0]["mean"].equal(results[1]["mean"])   # what the note warns about does happen


def _stops_itself(rank: int, world_size: int) -> None:
    import signal

    import torch

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)   # as a learner's Ctrl-Z or `kill -STOP` would
    dist.all_reduce(torch.ones(1))


def test_a_stopped_rank_is_reported_stopped_with_its_stack():
    from zeroedu.launch import RankHangError

    with pytest.raises(RankHangError) as err:
        launch(_stops_itself, 2, hang_timeout=3, timeout=120)
    statuses, stacks = err.value.statuses, err.value.stacks
    assert statuses[1].startswith("stopped (SIGSTOP"), statuses
    assert "running user code" in statuses[1]          # what its slot said when it stopped
    assert "_stops_itself" in stacks[1], stacks[1]      # its stack, fetched by letting it run for the dump


def _noop(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.slow
def test_a_killed_launchers_multiprocessing_folder_is_removed_by_the_next_launch(tmp_path):
    import subprocess
    import tempfile
    import time

    script = tmp_path / "kernel.py"
    script.write_text("import sys, time, zeroedu\n"
                      "def sleeper(rank, world_size):\n"
                      "    time.sleep(3600)\n"
                      "if __name__ == '__main__':\n"
                      "    zeroedu.launch(sleeper, 2, hang_timeout=None)\n")
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    mark = os.path.join(tempfile.gettempdir(), f"zeroedu-pymp-{kernel.pid}")
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(mark):
            assert time.monotonic() < deadline and kernel.poll() is None, "the launcher did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        folder = open(mark).read().split("\n", 1)[1]
        assert os.path.basename(folder).startswith("pymp-") and os.path.isdir(folder)
    finally:
        kernel.kill()   # SIGKILL: multiprocessing's own cleanup never runs
        kernel.wait()
    assert os.path.isdir(folder)   # left behind, as the probe found
    assert launch(_noop, 2) == [0, 1]
    assert not os.path.exists(folder) and not os.path.exists(mark)
