"""Which Python and torch zeroedu runs on, and the few torch APIs that moved between those versions.

The supported ranges are declared in pyproject.toml (requires-python, the torch requirement); the constants here
repeat them for the messages of `zeroedu doctor`, the notebooks' setup cell and the Makefile, and
tests/test_compat.py checks that the two agree.

Why the torch floor is 2.8: reading the code, 2.6 would do (the first release whose `torch.distributed.fsdp` exports
FSDP2's `fully_shard` and `CPUOffloadPolicy`, the bench's peers; `torch.distributed._tools.mem_tracker.MemTracker`,
their memory meter, dates from 2.5). Run here, 2.6.0 fails at launch: its default TCPStore (libuv) refuses the
listening socket launch() hands it (`master_listen_fd`: "The libuv TCPStore backend does not support initialization
with an listen fd"), and so does 2.7.1; 2.8.0 ran the tour with every stage equal to theory (each on Python 3.12,
6 December 2026). The
single-tensor collectives were renamed in 2.13 (`all_gather_single`, `reduce_scatter_single`; the old names warn as
deprecated), so older releases get the old names from here. "Tested" means run here (docs/instructors.md).

No torch import at module level: doctor and the setup cell use this module to explain a missing or wrong torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

PYTHON_MIN = (3, 10)          # the oldest Python the supported torch releases ship wheels for
PYTHON_BELOW = (3, 15)        # torch 2.13-2.15 ship wheels up to 3.14
TORCH_MIN = (2, 8)
TORCH_BELOW = (2, 16)         # 2.15 is the newest release today; a newer one is untried, not known broken
TORCH_DEFAULT = "2.13.0"      # what `make` installs (pyproject.toml [tool.zeroedu] tested-torch)
TESTED_TORCH = ("2.13.0", "2.14.1")
TESTED_PYTHON = ((3, 11), (3, 12))

PYTHON_RANGE = f">={PYTHON_MIN[0]}.{PYTHON_MIN[1]},<{PYTHON_BELOW[0]}.{PYTHON_BELOW[1]}"
TORCH_RANGE = f">={TORCH_MIN[0]}.{TORCH_MIN[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '2.16.0.dev20261201' -> (2, 16, 0): the local part names a build, not a
    version."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _span(low: tuple[int, int], below: tuple[int, int]) -> str:
    return f"{low[0]}.{low[1]} to {below[0]}.{below[1] - 1}"


def python_problem(version_info: Sequence[int] | None = None) -> str | None:
    """None if this Python is in the supported range, else what is wrong and how to fix it."""
    v = tuple(sys.version_info[:3] if version_info is None else version_info)
    if PYTHON_MIN <= tuple(v[:2]) < PYTHON_BELOW:
        return None
    found = ".".join(map(str, v))
    return (f"Python {found} is outside zeroedu's range, Python {_span(PYTHON_MIN, PYTHON_BELOW)} (the Pythons the "
            f"supported torch releases ship wheels for). Fix: install Python 3.11 (or 3.12) and make the course's "
            f"environment with it, e.g. `make PY=python3.11 tour`")


def torch_problem(version: str | None = None) -> str | None:
    """None if this torch (default: the installed one) is in the supported range, else what is wrong and the fix."""
    if version is None:
        try:
            import torch
        except ImportError:
            return (f"torch is not installed. Fix: `make tour` in the course folder installs torch=={TORCH_DEFAULT} "
                    f"(the CPU build), or pip install 'torch{TORCH_RANGE}'")
        version = torch.__version__
    if TORCH_MIN <= release(version)[:2] < TORCH_BELOW:
        return None
    side = "older" if release(version)[:2] < TORCH_MIN else "newer"
    return (f"torch {version} is {side} than zeroedu's range, torch {_span(TORCH_MIN, TORCH_BELOW)} "
            f"({TORCH_RANGE}). Fix: pip install 'torch=={TORCH_DEFAULT}' (the tested default; on Linux without a "
            "GPU add --index-url https://download.pytorch.org/whl/cpu), or any torch in the range")


def tested(torch_version: str | None = None, version_info: Sequence[int] | None = None) -> bool:
    """Whether this torch and Python are among the combinations run here (docs/instructors.md)."""
    v = tuple(sys.version_info[:2] if version_info is None else version_info[:2])
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    return (any(release(torch_version)[:3] == release(t) for t in TESTED_TORCH) and v in TESTED_PYTHON)


# -- torch APIs that moved -----------------------------------------------------------------------------------------

def all_gather_single() -> Callable:
    """dist.all_gather_single (2.13+), else its old name all_gather_into_tensor: same signature and semantics."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single() -> Callable:
    """dist.reduce_scatter_single (2.13+), else its old name reduce_scatter_tensor."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def finalizers_run_at_exit() -> None:
    """Make weakref.finalize's exit hook run in this freshly forked rank, on every Python in the range.

    Python 3.13's forkserver clears the atexit handlers of each child it forks (`atexit._clear()` in
    multiprocessing/forkserver.py, new in 3.13). weakref.finalize registers its one exit hook the first time any
    finalizer is made and remembers that in a class flag; torch makes one while the forkserver imports it, so in a
    3.13 rank the flag says "registered" while atexit holds nothing, and no finalizer with atexit=True runs at exit:
    an engine's NVMe swap folder (engine/extras/offload/swap.py) was left behind when a rank was stopped. Registering
    the hook again (once: unregister first) restores what 3.10-3.12 do. Private names of the standard library, read
    defensively: where they are missing, nothing changes."""
    import atexit
    import weakref

    hook = getattr(weakref.finalize, "_exitfunc", None)
    if hook is None or not getattr(weakref.finalize, "_registered_with_atexit", False):
        return   # no finalizer yet: the first one registers the hook itself
    atexit.unregister(hook)
    atexit.register(hook)
