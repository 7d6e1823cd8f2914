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
def test_overall_timeout(procs):
    t = time.monotonic()
    with pytest.raises(RankHangError) as err:
        launch(_sleep_everywhere, 2, timeout=2, hang_timeout=None)
    assert 2 < time.monotonic() - t < 8
    assert "timeout=2" in str(err.value) and all("sleep" in s for s in err.value.stacks.values())


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
        deadline = time.monotonic() + 5
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
    env["GLOO_SOCKET_IFNAME"] = L._loopback_interface()  # single machine: keep gloo on loopback
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
