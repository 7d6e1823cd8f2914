"""scripts/deepspeed_ops.py, which `make test` runs before its streams: a `lock` that a stopped build left in an
op's folder is removed (torch's loader would wait for it forever: CI's run on 6 December 2026 hung on one), and a
lock that a running build holds is kept. Real files, a real process working in the folder; no op is built."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("deepspeed_ops", ROOT / "scripts" / "deepspeed_ops.py")
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

pytestmark = pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="reads /proc (Linux)")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _lock(root: Path, name: str, age_s: float) -> Path:
    lock = root / "py311_cpu" / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_the_folder_is_torch_extensions_dir(root):
    assert ops.extensions_root() == root


def test_a_lock_left_by_a_stopped_build_is_removed_and_said(root):
    lock = _lock(root, "cpu_adam", age_s=7200)
    said = ops.clear_stale_lock("cpu_adam")
    assert not lock.exists()
    assert len(said) == 1 and said[0].startswith(f"removed {lock}") and "120 min ago" in said[0]
    assert ops.clear_stale_lock("cpu_adam") == []   # nothing left to say


def test_a_lock_whose_folder_a_process_works_in_is_kept(root):
    lock = _lock(root, "fused_adam", age_s=7200)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    try:
        said = ops.clear_stale_lock("fused_adam")
    finally:
        worker.kill()
        worker.wait()
    assert lock.exists() and "held by a build that is running" in said[0]
    assert ops.clear_stale_lock("fused_adam")[0].startswith("removed")   # once the build is gone


def test_a_young_lock_is_kept_and_other_ops_are_left_alone(root):
    young = _lock(root, "cpu_adam", age_s=5)
    other = _lock(root, "deepspeed_shm_comm", age_s=7200)
    assert "held by a build" in ops.clear_stale_lock("cpu_adam")[0]
    assert young.exists() and other.exists()


def test_torch_would_wait_for_the_stale_lock_until_it_is_removed(root):
    """The premise, from torch's own loader: it builds an extension in its folder only when it can create the
    folder's `lock` (torch.utils.file_baton.FileBaton, 'lock' in cpp_extension._jit_compile), and otherwise waits,
    with no limit, for the file to go."""
    import inspect

    import torch.utils.cpp_extension as cpp
    from torch.utils.file_baton import FileBaton

    assert "FileBaton(os.path.join(build_directory, 'lock'))" in inspect.getsource(cpp._jit_compile)
    lock = _lock(root, "cpu_adam", age_s=7200)
    assert FileBaton(str(lock)).try_acquire() is False     # torch would wait here
    ops.clear_stale_lock("cpu_adam")
    baton = FileBaton(str(lock))
    assert baton.try_acquire() is True                     # and now builds
    baton.release()
