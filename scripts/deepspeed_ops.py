"""Build the C++ ops DeepSpeed compiles on first use on a CPU machine, before the tests need them.

DeepSpeed 0.19.8 compiles an op the first time it is used (JIT, into torch's extension folder: TORCH_EXTENSIONS_DIR,
~/.cache/torch_extensions by default): its shared-memory collectives whenever it initializes on CPU, CPUAdam and
FusedAdam when a config asks for them (tests/test_corpus.py). Idle, each takes under a minute on the course's
2-core machine (measured: CPUAdam 39-57 s, FusedAdam 41-64 s); beside nbval one took over ten minutes. So
`make test` runs this first, before its two streams start, into a folder of the clone's own (build/), and the
tests then load the cached ops in seconds.

Torch guards a build with a `lock` file in the op's folder and waits, with no time limit and no message, while it
exists; a build that was stopped (Ctrl-C, a killed test run) leaves it behind, and every later load of that op
hangs. A lock that no running build holds (no process works in that folder, and the lock is over a minute old) is
removed here, with a line that says so.

    python scripts/deepspeed_ops.py      build them (nothing to do when DeepSpeed is not installed); always exits
                                         0: an op that does not build leaves its configs out of the comparison,
                                         and the test says which and why
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

# builder class -> the folder torch builds it in (the builder's NAME)
OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "CPUAdamBuilder": "cpu_adam", "FusedAdamBuilder": "fused_adam"}
BUILD_LIMIT_S = 1200   # a build that takes longer leaves its configs out (CI's whole budget is 90 min)
LOCK_GRACE_S = 60      # a younger lock may belong to a build that has not started its compiler yet


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its per-user cache folder."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _working_in(folder: Path) -> bool:
    """Does a running process have `folder` as its working directory (torch runs ninja, and ninja the compiler,
    in the op's folder)? Read from /proc; where there is none, say yes (keep the lock)."""
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return True
    target = str(folder.resolve())
    for pid in proc.iterdir():
        if pid.name.isdigit():
            try:
                if os.readlink(pid / "cwd") == target:
                    return True
            except OSError:
                continue
    return False


def clear_stale_lock(folder_name: str) -> list[str]:
    """Remove the `lock` a stopped build left in the op's folder; one line for each lock removed or kept."""
    said = []
    for lock in extensions_root().glob(f"*/{folder_name}/lock"):
        age = time.time() - lock.stat().st_mtime
        if age < LOCK_GRACE_S or _working_in(lock.parent):
            said.append(f"{lock} is held by a build that is running ({age:.0f} s old): waiting for it")
            continue
        lock.unlink(missing_ok=True)
        said.append(f"removed {lock}: a build that was stopped {age / 60:.0f} min ago left it, and torch would "
                    "wait for it forever")
    return said


def available(op: str, limit_s: float = BUILD_LIMIT_S) -> str | None:
    """None when DeepSpeed's `op` builds here (or loads from the cache), else why not. Built in a child process,
    with a time limit, while this process holds a lock of its own on the extensions folder (the kernel releases
    it when the process ends, however it ends), so that two of these never build in one folder at once."""
    root = extensions_root()
    root.mkdir(parents=True, exist_ok=True)
    code = (f"from deepspeed.ops.op_builder import {op}; b = {op}(); "
            f"assert b.is_compatible(True), 'not compatible with this machine'; b.load()")
    with open(root / ".zeroedu-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for line in clear_stale_lock(OPS[op]):
            print(f"  {line}", flush=True)
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return f"DeepSpeed's {op} did not build within {limit_s:.0f} s (its folder: {root})"
    if done.returncode < 0:
        return f"DeepSpeed's {op} build was stopped by signal {-done.returncode}"
    if done.returncode:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return f"DeepSpeed's {op} does not build here: {tail}"
    return None


def main() -> int:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("DeepSpeed is not installed: no ops to build")
        return 0
    print(f"DeepSpeed's C++ ops, into {extensions_root()}:", flush=True)
    for op in OPS:
        t0 = time.perf_counter()
        why = available(op)
        took = time.perf_counter() - t0
        print(f"  {op}: " + ("ready" if why is None else why) + f" ({took:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
