"""zeroedu.launch with real processes and real gloo collectives: results, failures, hangs, torchrun.

Every failure test also checks that it finished quickly and left no rank process behind (a /proc scan of this
test process's descendants; multiprocessing's forkserver and resource tracker are expected to stay).
"""

import importlib
import linecache
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from zeroedu.launch import (
    CollectiveMismatchError,
    LaunchError,
    LaunchTimeoutError,
    RankError,
    RankHangError,
    in_launched_rank,
    launch,
    report_status,
)

L = importlib.import_module("zeroedu.launch")  # the module (zeroedu.launch is also the function)
ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))

# Ship this file's functions by value, as a notebook cell's would be: the ranks need not import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- helpers -------------------------------------------------------------------------------------------------

def _process_tree() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in "ZX":  # zombies and dead entries are not running processes
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rank_processes() -> set[int]:
    """Live descendants of this process, except multiprocessing's long-lived forkserver and resource tracker
    (the forkserver's children, the ranks, are counted)."""
    tree = _process_tree()
    helpers = {p for p in tree.get(os.getpid(), []) if "forkserver import main" in _cmdline(p)
               or "resource_tracker import main" in _cmdline(p)}
    found, todo = set(), [os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found - helpers


def _assert_no_orphans(before: set[int]) -> None:
    deadline = time.monotonic() + 3
    while (left := _rank_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p, _cmdline(p)) for p in left]}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective(op: str, tensor: torch.Tensor, seq: int, group: str) -> None:
    """A torch.distributed collective reported to the launcher the way zeroedu's comm layer does it."""
    sig = f"{op} {str(tensor.dtype).removeprefix('torch.')}[{tensor.numel()}] (other)"
    report_status(f"waiting|{group}|{seq}|{sig}")
    if op == "all_reduce":
        dist.all_reduce(tensor)
    elif op == "broadcast":
        dist.broadcast(tensor, src=0)
    else:
        raise ValueError(op)
    report_status(f"done|{group}|{seq}|{sig}")


@pytest.fixture
def procs():
    """Yields the set of processes alive before the test; checks afterwards that none were added."""
    before = _rank_processes()
    yield before
    _assert_no_orphans(before)


# -- functions the ranks run ---------------------------------------------------------------------------------

def _sum_of_ranks(rank, world_size, scale=1.0):
    t = torch.tensor([scale * (rank + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                          "ZEROEDU_TEST_MARKER")}
    return {"rank": rank, "world_size": world_size, "dist_rank": dist.get_rank(), "sum": t.item(),
            "tensor": torch.arange(3) * rank, "env": env, "threads": torch.get_num_threads(),
            "backend": dist.get_backend(), "in_rank": in_launched_rank()}


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(0.2)  # the other ranks are already blocked in the all_reduce below
        raise ValueError("boom from the test")
    dist.all_reduce(torch.ones(2))


def _die_on_rank_1(rank, world_size, how):
    if rank == 1:
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes
            ctypes.string_at(0)
    dist.all_reduce(torch.ones(2))


def _sleep_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    _collective("all_reduce", torch.ones(4), 1, ",".join(map(str, range(world_size))))


def _mismatched(rank, world_size):
    _collective("all_reduce", torch.ones(3), 1, "0,1")
    _collective("all_reduce" if rank == 0 else "broadcast", torch.ones(4), 2, "0,1")


def _rank_1_leaves(rank, world_size):
    _collective("all_reduce", torch.ones(3), 1, "0,1")
    if rank == 0:
        _collective("all_reduce", torch.ones(3), 2, "0,1")


def _uneven_but_correct(rank, world_size):
    t = torch.tensor([float(rank)])
    _collective("broadcast", t, 1, "0,1")
    if rank == 1:
        time.sleep(1.5)  # rank 0 waits 1.5 s in a matching collective: a lag, not a mismatch
    _collective("all_reduce", t, 2, "0,1")
    return t.item()


def _sleep_everywhere(rank, world_size):
    time.sleep(3600)


def _nested(rank, world_size):
    return launch(_sum_of_ranks, 2)


def _return_a_lock(rank, world_size):
    return threading.Lock()


class _SlowToLoadOnRank1:
    """An argument whose unpickling blocks on rank 1: that rank never joins the process group."""

    def __reduce__(self):
        return (_slow_load, ())


def _slow_load():
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return None


def _noop(rank, world_size, arg=None):
    return rank


# -- results -------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_by_rank(world_size, monkeypatch, procs):
    monkeypatch.setenv("ZEROEDU_TEST_MARKER", f"set-after-forkserver-{world_size}")  # env of this moment
    results = launch(_sum_of_ranks, world_size, kwargs={"scale": 0.5})
    assert [r["rank"] for r in results] == list(range(world_size))
    expected = 0.5 * world_size * (world_size + 1) / 2  # closed form of sum(0.5 * (r + 1))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size and r["dist_rank"] == rank
        assert r["sum"] == expected
        assert torch.equal(r["tensor"], torch.arange(3) * rank)
        assert r["backend"] == "gloo" and r["in_rank"] is True
        assert r["threads"] == max(1, os.cpu_count() // world_size)
        assert r["env"]["RANK"] == str(rank) and r["env"]["WORLD_SIZE"] == str(world_size)
        assert r["env"]["LOCAL_RANK"] == str(rank) and r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["env"]["MASTER_PORT"].isdigit()
        assert r["env"]["ZEROEDU_TEST_MARKER"] == f"set-after-forkserver-{world_size}"
    assert not in_launched_rank() and not dist.is_initialized()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["script", "python -c"])
def test_fn_defined_in_main(how, tmp_path):
    """fn lives in __main__, which the ranks cannot import by name (torch.multiprocessing.spawn fails here)."""
    code = (
        "import torch, torch.distributed as dist\n"
        "import zeroedu\n"
        "def main_fn(rank, world_size, base):\n"
        "    t = torch.tensor([float(base + rank)])\n"
        "    dist.all_reduce(t)\n"
        "    return (rank, t.item())\n"
        "if __name__ == '__main__':\n"
        "    print('RESULT', zeroedu.launch(main_fn, world_size=2, args=(5,)))\n")
    if how == "script":
        (tmp_path / "train.py").write_text(code)
        cmd = [PY, str(tmp_path / "train.py")]
    else:
        cmd = [PY, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT [(0, 11.0), (1, 11.0)]" in out.stdout  # (5 + 0) + (5 + 1)


NOTEBOOK_CELL = '''
import torch
import torch.distributed as dist

SCALE = 10

def helper(x):
    return x * SCALE

def cell_fn(rank, world_size):
    t = torch.tensor([helper(rank)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()

def cell_fail(rank, world_size):
    if rank == 1:
        raise KeyError("raised in a notebook cell")
    return rank
'''


@pytest.mark.timeout(60)
def test_fn_from_a_notebook_cell(procs):
    """What IPython does with a cell: compile it under a file name that exists only in linecache, exec it in
    __main__'s namespace. The ranks get the function by value; the traceback shows the cell's source line,
    which only the parent has."""
    filename = "/nonexistent/ipykernel_0/cell-7.py"
    linecache.cache[filename] = (len(NOTEBOOK_CELL), None, NOTEBOOK_CELL.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL, filename, "exec"), namespace)
    assert launch(namespace["cell_fn"], 3) == [30.0] * 3  # 10 * (0 + 1 + 2)
    with pytest.raises(RankError) as err:
        launch(namespace["cell_fail"], 2)
    assert err.value.rank == 1
    assert filename in err.value.traceback and 'raise KeyError("raised in a notebook cell")' in str(err.value)


# -- failures --------------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_rank_raises(procs):
    t = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(_raise_on_rank_1, 3)
    assert time.monotonic() - t < 10
    e = err.value
    assert isinstance(e, LaunchError) and isinstance(e, RuntimeError) and e.rank == 1
    msg = str(e)
    assert "rank 1" in msg and "ValueError" in msg and "boom from the test" in msg
    assert "Traceback (most recent call last)" in e.traceback and "_raise_on_rank_1" in e.traceback
    assert 'raise ValueError("boom from the test")' in e.traceback and e.traceback.strip() in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, expected", [("exit", "exit code 3"), ("sigkill", "SIGKILL"),
                                           ("segfault", "SIGSEGV")])
def test_rank_dies_without_raising(how, expected, procs):
    t = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(_die_on_rank_1, 2, args=(how,))
    assert time.monotonic() - t < 10
    assert err.value.rank == 1 and "rank 1" in str(err.value) and expected in str(err.value)
    if how == "sigkill":  # not blamed on the OOM killer alone; the kernel log is consulted
        assert "killed by SIGKILL (the kernel's out-of-memory killer, a user or a job scheduler)" in str(err.value)
        assert "kernel log" in str(err.value)
    if how == "segfault":  # faulthandler's dump from the rank's stderr is in the message
        assert "Segmentation fault" in str(err.value) and "_die_on_rank_1" in str(err.value)


@pytest.mark.timeout(60)
def test_hang_names_the_sleeping_rank_with_its_stack(procs):
    t = time.monotonic()
    with pytest.raises(RankHangError) as err:
        launch(_sleep_on_rank_1, 3, hang_timeout=3)
    assert 3 < time.monotonic() - t < 10
    e = err.value
    assert e.culprits == [1]
    assert "Likely culprit: rank 1" in str(e)
    assert "sleep" in e.stacks[1] and "time.sleep(3600)" in str(e)
    assert "all_reduce" in e.stacks[0] and "all_reduce" in e.stacks[2]  # the waiting ranks' stacks
    assert "waiting in all_reduce float32[4]" in e.statuses[0] and "running user code" in e.statuses[1]


@pytest.mark.timeout(60)
def test_overall_timeout_says_it_is_a_limit(procs):
    t = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as err:
        launch(_sleep_everywhere, 2, timeout=2, hang_timeout=None)
    assert 2 < time.monotonic() - t < 10
    msg = str(err.value)
    assert "stopped at its time limit" in msg and "timeout=2" in msg and "That is a limit, not a diagnosis" in msg
    assert "hung" not in msg and "raise hang_timeout" not in msg and "culprit" not in msg and not err.value.culprits
    assert all("sleep" in s for s in err.value.stacks.values())


@pytest.mark.timeout(60)
def test_mismatched_collectives(procs):
    t = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as err:
        launch(_mismatched, 2)
    assert time.monotonic() - t < 10
    msg = str(err.value)
    assert "rank 0: waiting in all_reduce float32[4] (other), collective #2 of group 0,1" in msg
    assert "rank 1: waiting in broadcast float32[4] (other), collective #2 of group 0,1" in msg


@pytest.mark.timeout(60)
def test_rank_leaves_while_others_wait(procs):
    with pytest.raises(CollectiveMismatchError) as err:
        launch(_rank_1_leaves, 2)
    msg = str(err.value)
    assert "rank 1 returned from fn while rank 0 waits in all_reduce float32[3]" in msg and "#2" in msg


@pytest.mark.timeout(60)
def test_a_lagging_rank_is_not_a_mismatch(procs):
    assert launch(_uneven_but_correct, 2) == [0.0, 0.0]  # broadcast of rank 0's 0.0, then 0.0 + 0.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", True, None])
def test_world_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        launch(_noop, bad)


@pytest.mark.timeout(30)
def test_too_many_ranks_for_memory_fails_before_starting(procs):
    t = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(_noop, 10000)
    assert time.monotonic() - t < 1
    msg = str(err.value)
    assert "world_size=10000" in msg and "5000 GB" in msg and "MemAvailable" in msg and "world_size <=" in msg


@pytest.mark.timeout(30)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without enough GPUs")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(LaunchError, match="backend='gloo'"):
        launch(_noop, 2, backend="nccl")


@pytest.mark.timeout(30)
def test_unpicklable_arguments_fail_before_starting(procs):
    with pytest.raises(LaunchError, match="cloudpickle"):
        launch(_noop, 2, args=(threading.Lock(),))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args", [None, 5, "ab"])
def test_arguments_that_are_not_a_tuple_say_how_to_write_one(procs, args):
    with pytest.raises(TypeError, match=r"args=\(value,\)"):
        launch(_noop, 2, args=args)


@pytest.mark.timeout(60)
def test_unpicklable_return_value(procs):
    with pytest.raises(RankError, match="cannot be pickled"):
        launch(_return_a_lock, 2)


@pytest.mark.timeout(60)
def test_launch_inside_a_rank(procs):
    with pytest.raises(RankError, match="inside rank 0|inside rank 1"):
        launch(_nested, 2)


@pytest.mark.timeout(60)
def test_rank_that_never_joins(monkeypatch, procs):
    monkeypatch.setattr(L, "START_TIMEOUT", 2.0)
    t = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch(_noop, 2, args=(_SlowToLoadOnRank1(),))
    assert time.monotonic() - t < 8
    msg = str(err.value)
    assert "did not start and join the process group" in msg
    assert "rank 1: starting: loading fn and its arguments" in msg and "rank 0: joining" in msg


@pytest.mark.timeout(60)
def test_ranks_die_with_a_killed_parent(tmp_path):
    """A notebook kernel killed with SIGKILL must not leave its ranks running."""
    script = tmp_path / "kernel.py"
    script.write_text(
        "import os, sys, time\n"
        "import zeroedu\n"
        "def sleeper(rank, world_size, d):\n"
        "    with open(os.path.join(d, f'{rank}.pid'), 'w') as f:\n"
        "        f.write(f'{os.getpid()} {os.getppid()}')\n"
        "    time.sleep(3600)\n"
        "if __name__ == '__main__':\n"
        "    zeroedu.launch(sleeper, 2, args=(sys.argv[1],), hang_timeout=None)\n")
    kernel = subprocess.Popen([PY, str(script), str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 45
        while not all((tmp_path / f"{r}.pid").exists() for r in range(2)):
            assert time.monotonic() < deadline and kernel.poll() is None, "ranks did not start"
            time.sleep(0.1)
        time.sleep(0.1)
        pids = [int(x) for r in range(2) for x in (tmp_path / f"{r}.pid").read_text().split()]
        assert all(_alive(p) for p in pids)
        kernel.kill()
        kernel.wait()
        # The ranks see the parent's end of their pipe close at once; the limit only has to outlast a machine whose
        # cores other jobs hold (5 s was missed at a load average of 30).
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "rank processes (or their forkserver) outlived the parent"
    finally:
        kernel.kill()


def test_report_status_is_a_no_op_outside_launch():
    report_status("waiting|0,1|1|all_reduce float32[4] (other)")
    report_status(None)
    assert not in_launched_rank()
    import zeroedu  # zeroedu.launch is the function; the module's API hangs off it for the comm layer
    assert zeroedu.launch.report_status is report_status and zeroedu.launch.RankError is RankError


@pytest.mark.timeout(60)
def test_init_distributed_single_process():
    """No environment and no group: a world of one on gloo, listening on loopback only (fresh interpreter, so
    this test process keeps no process group)."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from zeroedu.launch import init_distributed\n"
        "for k in ('RANK', 'WORLD_SIZE', 'GLOO_SOCKET_IFNAME'): os.environ.pop(k, None)\n"
        "print('RESULT', init_distributed(), dist.get_backend(), init_distributed())\n"
        "t = torch.tensor([3.0]); dist.all_reduce(t); print('SUM', t.item())\n"
        "inodes = set()\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try: inodes.add(os.readlink(f'/proc/self/fd/{fd}'))\n"
        "    except OSError: pass\n"
        "bad = []\n"
        "for name in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
        "    for line in open(name).readlines()[1:]:\n"
        "        f = line.split()\n"
        "        loop = f[1].startswith('0100007F') or f[1].startswith('0000000000000000FFFF00000100007F')\n"
        "        if f[3] == '0A' and f'socket:[{f[9]}]' in inodes and not loop: bad.append(f[1])\n"
        "print('NONLOOPBACK', bad)\n"
        "dist.destroy_process_group()\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "RESULT (0, 1) gloo (0, 1)" in out.stdout and "SUM 3.0" in out.stdout
    assert "NONLOOPBACK []" in out.stdout


# -- torchrun ------------------------------------------------------------------------------------------------

def _torchrun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = L.loopback_interface()  # single machine: keep gloo on loopback
    return env


def _printed(output: str) -> dict[str, tuple[str, str, str]]:
    """The example's lines: '[RANK] ranks [...] all_reduce sums [...] expected X backend B'."""
    pattern = r"\[(\d+)\] ranks (\[[^\]]*\]) all_reduce sums (\[[^\]]*\]) expected ([\d.]+) backend"
    return {m[0]: m[1:] for m in re.findall(pattern, output)}


@pytest.mark.timeout(120)
def test_torchrun_one_node():
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "examples" / "torchrun_allreduce.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=_torchrun_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    printed = _printed(out.stdout)
    assert sorted(printed) == ["0", "1"]
    for ranks, sums, expected in printed.values():  # every rank got every rank's result, in rank order
        assert ranks == "[0, 1]" and sums == "[3.0, 3.0]" and float(expected) == 3.0


@pytest.mark.timeout(120)
def test_torchrun_two_nodes():
    """Two torchrun agents on one machine stand in for two nodes, rendezvousing over c10d on loopback."""
    port = _free_port()
    nodes = [subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zeroedu-test-{port}",
         str(ROOT / "examples" / "torchrun_allreduce.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_torchrun_env(), cwd=ROOT) for n in range(2)]
    try:
        outs = [node.communicate(timeout=110) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outs
    printed = [_printed(stdout) for stdout, _ in outs]
    assert sorted(k for p in printed for k in p) == ["0", "1"]  # one rank per node
    for p in printed:
        for ranks, sums, expected in p.values():
            assert ranks == "[0, 1]" and sums == "[3.0, 3.0]" and float(expected) == 3.0


@pytest.mark.timeout(60)
def test_world_size_must_match_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="WORLD_SIZE=2"):
        launch(_noop, 4)


# -- torch.distributed called directly: hangs and mismatches named within hang_timeout ------------------------

def _stamp(path):
    """Write when this rank entered its last collective: the test measures detection from there."""
    with open(path, "w") as f:
        f.write(str(time.time()))


def _raw_mismatch(rank, world_size, stamp):
    t = torch.ones(4)
    dist.all_reduce(t)               # one good collective first: #1
    _stamp(f"{stamp}.{rank}")
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def _raw_hang(rank, world_size, stamp, async_op):
    if rank == 1:
        time.sleep(3600)
    _stamp(f"{stamp}.{rank}")
    if async_op:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
    else:
        dist.all_reduce(torch.ones(4))


def _detected_after(stamp: str, ranks) -> float:
    return time.time() - max(float(open(f"{stamp}.{r}").read()) for r in ranks)


@pytest.mark.timeout(120)
def test_raw_dist_mismatch_is_named_within_hang_timeout(tmp_path, procs):
    stamp = str(tmp_path / "stamp")
    with pytest.raises(CollectiveMismatchError) as err:
        launch(_raw_mismatch, 2, args=(stamp,), hang_timeout=30)
    assert _detected_after(stamp, (0, 1)) < 30 + 10
    msg = str(err.value)
    assert "collective #2 of group 0,1" in msg
    assert "rank 0 is in torch.distributed.all_reduce float32[4]" in msg
    assert "rank 1 in torch.distributed.broadcast float32[4]" in msg
    line = _raw_mismatch.__code__.co_firstlineno
    assert f"test_launch.py:{line + 5}" in msg and f"test_launch.py:{line + 7}" in msg   # each rank's line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async-then-wait"])
def test_raw_dist_hang_is_named_within_hang_timeout(async_op, tmp_path, procs):
    stamp = str(tmp_path / "stamp")
    with pytest.raises(RankHangError) as err:
        launch(_raw_hang, 2, args=(stamp, async_op), hang_timeout=5)
    assert _detected_after(stamp, (0,)) < 5 + 10
    e = err.value
    assert e.culprits == [1] and "time.sleep(3600)" in e.stacks[1]
    assert "waiting in torch.distributed.all_reduce float32[4]" in e.statuses[0]
    assert "running user code" in e.statuses[1]


def _only_rank_0_saves(rank, world_size, d):
    import zeroedu
    from zeroedu.models import Quirky
    engine, *_ = zeroedu.initialize(model=Quirky(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1}})
    if rank == 0:
        engine.save_checkpoint(d)    # every rank must call it: rank 1 has returned


@pytest.mark.timeout(120)
def test_save_checkpoint_on_one_rank_is_named(tmp_path, procs):
    t = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as err:
        launch(_only_rank_0_saves, 2, args=(str(tmp_path / "ck"),))
    assert time.monotonic() - t < 60       # not the old 300 s launch timeout: seconds after the ranks start
    msg = str(err.value)
    assert "rank 1 returned from fn while rank 0 waits in torch.distributed.all_gather_object" in msg
    assert "via zeroedu.checkpoint" in msg and "test_launch.py" in msg


def _rank_0_saves_while_rank_1_trains(rank, world_size, d):
    import zeroedu
    from zeroedu.models import Quirky, gpt_loss, quirky_batch, shard_batch
    engine, *_ = zeroedu.initialize(model=Quirky(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1}})
    if rank == 0:
        engine.save_checkpoint(d)    # every rank must call it: rank 1 goes on training instead
        return
    for step in range(1000):
        x, y = shard_batch(*quirky_batch(step, 2 * world_size), rank, world_size)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()


@pytest.mark.timeout(120)
def test_raw_dist_against_zeroedus_collective_is_named_as_a_mismatch(tmp_path, procs):
    """Rank 0 in a torch.distributed collective (save_checkpoint's), rank 1 in one of zeroedu's comm layer: both
    layers count one group's collectives together, so this is a mismatch with both collectives named, not a hang."""
    t = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as err:
        launch(_rank_0_saves_while_rank_1_trains, 2, args=(str(tmp_path / "ck"),), hang_timeout=5)
    assert time.monotonic() - t < 5 + 30
    msg = str(err.value)
    assert "torch.distributed.all_gather_object" in msg and "via zeroedu.checkpoint" in msg, msg
    assert "all_reduce" in msg or "reduce_scatter" in msg or "all_gather " in msg, msg


def _raw_shape_mismatch(rank, world_size):
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))   # one collective, two sizes: gloo aborts the process


@pytest.mark.timeout(120)
def test_a_rank_aborted_by_gloo_keeps_gloos_message(procs):
    """gloo ends a size mismatch with a C++ exception (SIGABRT); its message comes before the stack dump that fills
    the stderr tail, and is kept."""
    with pytest.raises(RankError) as err:
        launch(_raw_shape_mismatch, 2, hang_timeout=10)
    msg = str(err.value)
    assert "SIGABRT" in msg and "Is there a distributed collective mismatch in your code?" in msg, msg


# -- limits: no default wall clock, and a timeout that says it is one ------------------------------------------

def test_no_default_wall_clock_limit():
    import inspect
    params = inspect.signature(launch).parameters
    assert params["timeout"].default is None and params["hang_timeout"].default == 30.0


def _steady_progress(rank, world_size, seconds):
    """A healthy run: a collective every half second for `seconds`. Rank 0's clock decides when to stop (sent in
    the collective itself), so every rank runs the same number of collectives whatever their start skew."""
    t0, n = time.monotonic(), 0
    while True:
        go = torch.tensor([1.0 if rank != 0 or time.monotonic() - t0 < seconds else 0.0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() == 0.0:
            return n
        time.sleep(0.5)
        n += 1


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("ZEROEDU_LONG_TESTS"), reason="a 6-minute run: set ZEROEDU_LONG_TESTS=1")
def test_a_six_minute_healthy_run_is_not_killed(procs):
    t = time.monotonic()
    counts = launch(_steady_progress, 2, args=(360,))     # the defaults: no timeout, hang_timeout 30 s
    assert time.monotonic() - t > 360 and counts[0] == counts[1] > 300


# -- signals: the parent or a rank stopped, folders cleaned ---------------------------------------------------

SIGNAL_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import zeroedu

def train_forever(rank, world_size, nvme):
    from zeroedu.models import Quirky
    engine, *_ = zeroedu.initialize(model=Quirky(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}})
    open(os.path.join(nvme, f"ready{rank}"), "w").write(str(os.getpid()))
    while True:
        dist.all_reduce(torch.ones(4))
        time.sleep(0.2)

if __name__ == "__main__":
    try:
        zeroedu.launch(train_forever, 2, args=(sys.argv[1],))
    except zeroedu.launch.LaunchError as e:
        print("LAUNCH ERROR", e, flush=True)
        sys.exit(3)
"""


def _start_signal_script(tmp_path, hangup=signal.SIG_DFL):
    (tmp_path / "run.py").write_text(SIGNAL_SCRIPT)
    nvme, tmp = tmp_path / "nvme", tmp_path / "tmp"
    nvme.mkdir()
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    # SIGHUP as `hangup` says, whatever this test run inherited (under nohup it is ignored)
    parent = subprocess.Popen([PY, str(tmp_path / "run.py"), str(nvme)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    deadline = time.monotonic() + 100
    while not all((nvme / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and parent.poll() is None, parent.communicate()
        time.sleep(0.1)
    time.sleep(0.3)
    swap = [p for p in os.listdir(nvme) if p.startswith("zeroedu-offload-")]
    runs = [p for p in os.listdir(tmp) if p.startswith("zeroedu-launch-")]
    assert len(swap) == 2 and len(runs) == 1, (swap, runs)   # there really is something to clean up
    ranks = [int((nvme / f"ready{r}").read_text()) for r in range(2)]
    return parent, nvme, tmp, ranks


def _left(nvme, tmp) -> list[str]:
    return [p for p in os.listdir(nvme) if p.startswith("zeroedu-offload-")] + \
        [p for p in os.listdir(tmp) if p.startswith("zeroedu-launch-")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_to_the_parent_leaves_no_folder(sig, tmp_path):
    parent, nvme, tmp, ranks = _start_signal_script(tmp_path)
    try:
        parent.send_signal(getattr(signal, sig))
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in err
    else:   # it dies of the signal, as it would have without launch, after cleaning up
        assert parent.returncode == -getattr(signal, sig), (parent.returncode, out, err)
    assert _left(nvme, tmp) == []
    assert not any(_alive(p) for p in ranks)
    # before stopping them, where each rank was: a run stuck where no check sees still shows its line
    assert "zeroedu launch(train_forever) interrupted after" in err and "--- rank 1 ---" in err
    assert "in train_forever" in err, err


@pytest.mark.timeout(180)
def test_under_nohup_a_hangup_leaves_the_run_going(tmp_path):
    """nohup ignores SIGHUP so that a run outlives its terminal: launch() keeps it ignored."""
    parent, nvme, tmp, ranks = _start_signal_script(tmp_path, hangup=signal.SIG_IGN)
    try:
        parent.send_signal(signal.SIGHUP)
        time.sleep(3)
        assert parent.poll() is None and all(_alive(p) for p in ranks)
        parent.send_signal(signal.SIGTERM)
        parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert parent.returncode == -signal.SIGTERM
    assert _left(nvme, tmp) == []


@pytest.mark.timeout(180)
def test_sigterm_to_a_rank_runs_its_cleanup_and_is_reported(tmp_path):
    parent, nvme, tmp, ranks = _start_signal_script(tmp_path)
    try:
        os.kill(ranks[1], signal.SIGTERM)
        out, err = parent.communicate(timeout=60)
    finally:
        parent.kill()
    assert parent.returncode == 3, (out, err)
    assert "rank 1 of 2 died without raising an exception: killed by SIGTERM (a user, a job scheduler" in out
    assert _left(nvme, tmp) == []
    assert not any(_alive(p) for p in ranks)


@pytest.mark.timeout(180)
def test_a_folder_left_by_a_killed_launch_is_removed_by_the_next(tmp_path):
    parent, nvme, tmp, ranks = _start_signal_script(tmp_path)
    parent.kill()                        # SIGKILL: nothing can clean up
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in os.listdir(tmp) if p.startswith("zeroedu-launch-")]
    assert len(left) == 1
    code = "import zeroedu\nif __name__ == '__main__':\n    print('RESULT', zeroedu.launch(lambda r, n: r, 2))\n"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)})
    assert "RESULT [0, 1]" in out.stdout, out.stderr
    assert f"zeroedu launch: removed {tmp / left[0]}" in out.stderr and "was killed" in out.stderr
    assert not [p for p in os.listdir(tmp) if p.startswith("zeroedu-launch-")]


# -- stdin scripts and SIGKILL wording -------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_script_piped_on_stdin_launches(tmp_path):
    code = ("import torch, torch.distributed as dist\nimport zeroedu\n"
            "def fn(rank, world_size):\n    t = torch.tensor([rank + 1.0])\n    dist.all_reduce(t)\n"
            "    return t.item()\n"
            "if __name__ == '__main__':\n    print('RESULT', zeroedu.launch(fn, world_size=2))\n")
    out = subprocess.run([PY, "-"], input=code, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT [3.0, 3.0]" in out.stdout


def test_the_kernel_log_line_of_the_oom_killer_is_found():
    from zeroedu.launch_diagnose import _kernel_kill_line, _kernel_log

    # the formats of mm/oom_kill.c (global and cgroup), as /dev/kmsg gives them after the "prio,seq,time,-;"
    lines = ["oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4242,uid=0",
             "Out of memory: Killed process 4242 (python) total-vm:9000kB, anon-rss:8000kB, file-rss:0kB, "
             "shmem-rss:0kB, UID:0 pgtables:40kB oom_score_adj:0",
             "Memory cgroup out of memory: Killed process 42421 (python) total-vm:1kB"]
    assert _kernel_kill_line(lines, 4242) == lines[1]
    assert _kernel_kill_line(lines, 42421) == lines[2]
    assert _kernel_kill_line(lines, 424) is None
    if os.access("/dev/kmsg", os.R_OK):   # where the log is readable, it is really read
        assert _kernel_log(), "/dev/kmsg is readable but nothing was read from it"


EXIT_RACE_SCRIPT = """
import atexit, threading, time
import sys, zeroedu.launch_rank
L = sys.modules["zeroedu.launch_rank"]
calls = []
def slow_cleanup():
    calls.append(time.monotonic())
    time.sleep(1.0)
    calls.append("done")
atexit.register(slow_cleanup)
first = threading.Thread(target=L._run_exit_handlers, args=(5.0,))
first.start()
while not calls:
    time.sleep(0.01)
L._run_exit_handlers(5.0)     # a stop signal arriving while the error path runs the handlers
print(calls.count("done"), len(calls))
"""


def test_exit_handlers_run_once_and_a_second_caller_waits_for_them():
    """The race behind a swap folder left on SIGTERM: rank 0's error path was running the exit handlers when
    launch's SIGTERM arrived; the signal thread's call returned at once and the rank died mid-cleanup."""
    out = subprocess.run([PY, "-c", EXIT_RACE_SCRIPT], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["1", "2"], (out.stdout, out.stderr)
