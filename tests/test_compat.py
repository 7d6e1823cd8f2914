"""zeroedu.compat: the supported ranges agree with pyproject.toml, the messages name what was found, the range and
the fix, and the renamed collectives give what the old names give, on real gloo ranks."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import zeroedu
from zeroedu import compat

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the 3.10 leg of the range
        pytest.skip("tomllib is Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_ranges_agree_with_pyproject():
    project = pyproject()
    assert SpecifierSet(project["project"]["requires-python"]) == SpecifierSet(compat.PYTHON_RANGE)
    (torch_req,) = [Requirement(d) for d in project["project"]["dependencies"] if Requirement(d).name == "torch"]
    assert torch_req.specifier == SpecifierSet(compat.TORCH_RANGE)
    default = project["tool"]["zeroedu"]["tested-torch"]
    assert default == compat.TORCH_DEFAULT and default in compat.TESTED_TORCH
    for v in compat.TESTED_TORCH:
        assert Version(v) in torch_req.specifier, v
    for major, minor in compat.TESTED_PYTHON:
        assert Version(f"{major}.{minor}.0") in SpecifierSet(compat.PYTHON_RANGE)


@pytest.mark.parametrize("text", ["2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.6.0", "2.16.0.dev20261201",
                                  "2.15.0rc1", "2.9.1a0+git1234"])
def test_release_matches_packaging(text):
    assert compat.release(text)[:3] == Version(text).release[:3]


def test_version_checks_name_version_range_and_fix():
    assert compat.python_problem((3, 11, 7)) is None and compat.python_problem((3, 14, 0)) is None
    for v in [(3, 9, 18), (3, 15, 0)]:
        msg = compat.python_problem(v)
        assert msg and ".".join(map(str, v)) in msg and "3.10 to 3.14" in msg and "Fix:" in msg, msg
    assert compat.torch_problem(torch.__version__) is None      # the torch these tests run on
    for v in ["2.8.0", "2.13.0+cpu", "2.15.2"]:
        assert compat.torch_problem(v) is None, v
    for v, side in [("2.7.1", "older"), ("2.6.0", "older"), ("1.13.1", "older"), ("2.16.0", "newer"),
                    ("3.0.0", "newer")]:
        msg = compat.torch_problem(v)
        assert msg and v in msg and side in msg and "2.8 to 2.15" in msg and "torch==2.13.0" in msg, msg
    assert compat.tested("2.13.0+cpu", (3, 11)) and compat.tested("2.14.1", (3, 12))
    assert not compat.tested("2.9.0", (3, 11)) and not compat.tested("2.13.0", (3, 13))


def _both_names(rank: int, world_size: int) -> dict[str, list[float]]:
    """Each rank gathers and reduce-scatters with the name compat picks and with the old name (present, deprecated,
    in the torch run here); returns all four outputs."""
    import warnings

    x = torch.arange(3, dtype=torch.float32) + 10 * rank
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)    # the old names warn as deprecated from 2.13
        for name, fn in [("new", compat.all_gather_single()), ("old", dist.all_gather_into_tensor)]:
            gathered = torch.empty(3 * world_size)
            fn(gathered, x)
            out[f"gather_{name}"] = gathered.tolist()
        big = torch.arange(2 * world_size, dtype=torch.float32) * (rank + 1)
        for name, fn in [("new", compat.reduce_scatter_single()), ("old", dist.reduce_scatter_tensor)]:
            piece = torch.empty(2)
            fn(piece, big.clone())
            out[f"scatter_{name}"] = piece.tolist()
    return out


@pytest.mark.timeout(200)
def test_collective_names_agree_on_gloo_ranks():
    world = 2
    results = zeroedu.launch(_both_names, world_size=world, timeout=150)
    total = sum(r + 1 for r in range(world))       # closed form: rank r's vector is arange * (r + 1)
    for rank, out in enumerate(results):
        expected_gather = [float(i + 10 * r) for r in range(world) for i in range(3)]
        assert out["gather_new"] == out["gather_old"] == expected_gather
        assert out["scatter_new"] == out["scatter_old"] == [float(i * total) for i in (2 * rank, 2 * rank + 1)]


def test_collectives_module_uses_compat():
    """The engine's collectives take their names from compat, so a torch without the new names still runs."""
    from zeroedu import collectives

    assert collectives.ALL_GATHER_SINGLE is compat.all_gather_single()
    assert collectives.REDUCE_SCATTER_SINGLE is compat.reduce_scatter_single()
    src = (ROOT / "zeroedu" / "compat.py").read_text()
    assert re.search(r"fully_shard", src)  # the floor's reason is written down where the range is


def test_finalizers_run_at_exit_after_the_forkserver_cleared_atexit():
    """Python 3.13's forkserver calls atexit._clear() in each rank it forks, after torch (imported there) made a
    weakref.finalize, so finalizers no longer ran at exit in a rank (an NVMe swap folder stayed behind). The same
    steps in a fresh Python that exits as a rank does (exit handlers, then os._exit), on any version: without
    compat.finalizers_run_at_exit() nothing is finalized at exit, with it both finalizers run."""
    import subprocess
    import sys

    code = ("import atexit, os, sys, weakref\n"
            "class A: pass\n"
            "a = A(); weakref.finalize(a, print, 'first')\n"
            "atexit._clear()   # what multiprocessing/forkserver.py does in 3.13\n"
            "from zeroedu.compat import finalizers_run_at_exit\n"
            "if sys.argv[1] == 'fix': finalizers_run_at_exit(); finalizers_run_at_exit()   # twice: still once\n"
            "b = A(); weakref.finalize(b, print, 'second')\n"
            "atexit._run_exitfuncs(); sys.stdout.flush(); os._exit(0)   # how a rank exits (launch/rank.py)\n")
    out = {how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
           for how in ("as-is", "fix")}
    assert out["as-is"].returncode == 0 and out["as-is"].stdout == "", out["as-is"]
    assert out["fix"].stdout.splitlines() == ["second", "first"], out["fix"]
