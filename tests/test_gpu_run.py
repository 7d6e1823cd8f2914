"""scripts/gpu_run.py's logic, run on the CPU in its dry mode before any GPU time is spent on it.

The references are independent of the script: zeroedu.theory's closed forms (themselves checked against the ZeRO
paper in tests/test_theory*.py) for the meter's model-state bytes, and the JSON layout that
notebooks/90_appendix_gpu.ipynb reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroedu import theory

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_dry")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "scripts/gpu_run.py", "--dry", "--out", str(out), "--only", "memory",
                           "offload", "checkpointing"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "dry_run.json").read_text())


def test_the_dry_run_says_what_it_is(dry):
    assert dry["dry_run"] is True
    assert dry["device"].startswith("CPU") and dry["torch"] and dry["date"]


def test_every_stage_measured_with_the_theory_beside_it(dry):
    mem = dry["sections"]["memory"]
    assert sorted(mem) == ["seconds", "stage 0", "stage 1", "stage 2", "stage 3"]
    for k in range(4):
        r = mem[f"stage {k}"]
        psi = 4 * (256 * 256 + 256)                    # the dry run's MLP: 4 x Linear(256, 256)
        assert r["psi"] == psi
        assert r["theory_model_states"]["total"] == theory.model_state_bytes(psi, 1, k, "bf16")["total"] == 16 * psi
        assert r["meter_model_states"] == r["theory_model_states"]["total"]   # world size 1: no padding
        assert r["cuda_max_allocated"] is None and len(r["step_seconds"]) == 3


def test_offload_rates_and_steps_are_recorded(dry):
    off = dry["sections"]["offload"]
    assert off["bytes_per_s"]["h2d"] > 0 and off["bytes_per_s"]["d2h"] > 0
    assert off["cpu_adam_elements_per_s"] > 0 and off["gpu_fused_adam_elements_per_s"] is None
    assert set(off["steps"]) == {"stage 2", "stage 2 + offload_optimizer cpu"}
    assert off["steps"]["stage 2 + offload_optimizer cpu"]["offload"] == "cpu"


def test_recomputation_is_timed_with_and_without(dry):
    ck = dry["sections"]["checkpointing"]
    assert "error" not in ck and set(ck) >= {"plain", "checkpointed"}
    assert all(len(ck[k]["step_seconds"]) == 3 for k in ("plain", "checkpointed"))


def test_without_a_gpu_the_real_mode_refuses_and_says_how():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, "scripts/gpu_run.py", "--out", "/nonexistent"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--dry" in done.stderr
