"""zeroedu doctor: each check on this machine (real ranks, real sockets, real files) and with forced failing inputs.

Expected values come from outside the doctor: pyproject.toml read with tomllib, /proc/meminfo, shutil.disk_usage,
JupyterLab's extension loader, and closed forms (the all_reduce of rank+1 over n ranks sums to n(n+1)/2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from zeroedu import doctor
from zeroedu.doctor import FAIL, OK, WARN, Result

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: the test extra installs tomli, tomllib's origin
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# the Pythons the course has run its tests on (docs/instructors.md, the matrix): ok there, a warning elsewhere in range
TESTED_PYTHONS = {(3, 11), (3, 12)}
HERE_PYTHON_STATUS = OK if sys.version_info[:2] in TESTED_PYTHONS else WARN
BIN = Path(sys.executable).parent
GiB = 2**30

# probes below run in rank processes: ship them by value, as a notebook cell's function would be
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def pyproject_torch_pin() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["zeroedu"]["tested-torch"]


def assert_problem(result: Result, status: str, *words: str) -> None:
    """A problem row: the expected status, a detail, and a fix that names something to do."""
    assert result.status == status, result
    assert result.detail and result.fix, result
    for word in words:
        assert word in result.detail + " " + result.fix, (word, result)


# -- versions ----------------------------------------------------------------------------------------------------

def test_python():
    """The range is pyproject's requires-python (read here with packaging, not from zeroedu): tested Pythons are ok,
    the rest of the range a warning, anything outside a FAIL naming the version, the range and a fix."""
    from packaging.specifiers import SpecifierSet

    requires = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert doctor.check_python().status == HERE_PYTHON_STATUS
    assert doctor.check_python((3, 11, 0)).status == OK
    for v in [(3, 9, 18), (3, 10, 14), (3, 12, 1), (3, 13, 0), (3, 14, 2), (3, 15, 0)]:
        row = doctor.check_python(v)
        text = ".".join(map(str, v))
        if text not in requires:
            assert_problem(row, FAIL, text, "3.10 to 3.14", "make PY=python3.11")
        else:
            assert row.status in (OK, WARN) and text in row.detail and "3.15" in row.detail, row


def test_torch_against_pyproject_range():
    pin = pyproject_torch_pin()
    assert doctor._torch_pin() == pin
    real = doctor.check_torch()
    assert real.status == OK and real.data["pin"] == pin
    if real.data["cuda"] is None:   # the course's CPU build; a matrix venv has PyPI's CUDA build
        assert "CPU build" in real.detail, real
    else:
        assert f"CUDA {real.data['cuda']} build" in real.detail, real
    assert doctor.check_torch("2.13.0+cpu", None, "2.13.0", nvidia_gpus=0).status == OK
    assert doctor.check_torch("2.14.1", None, "2.13.0", nvidia_gpus=0).status == OK    # the matrix's torch
    assert "CUDA 12.6 build" in doctor.check_torch("2.13.0+cu126", "12.6", "2.13.0", nvidia_gpus=1).detail
    old = doctor.check_torch("2.5.1", None, "2.13.0", nvidia_gpus=0)
    assert_problem(old, FAIL, "2.5.1", "older", "2.8 to 2.15", "torch==2.13.0")
    assert old.fix == doctor.torch_install_fix("2.13.0", 0) + " (into the course's environment)"
    newest = doctor.check_torch("2.16.0+cu130", "13.0", "2.13.0", nvidia_gpus=2)
    assert_problem(newest, FAIL, "2.16.0", "newer", "torch==2.13.0")
    assert "whl/cpu" not in newest.fix  # a CUDA user is not told to install the CPU wheel
    # in the range, not run here (Colab's torch, say): it runs, with a warning that says what is tested
    hosted = doctor.check_torch("2.9.0+cu126", "12.6", "2.13.0", nvidia_gpus=1)
    assert_problem(hosted, WARN, "2.9.0", "2.13.0, 2.14.1")
    # a CPU build on a machine with an NVIDIA GPU runs the course, but leaves the GPU path unused
    assert_problem(doctor.check_torch("2.13.0+cpu", None, "2.13.0", nvidia_gpus=1), WARN, "1 NVIDIA GPU", "CUDA build")
    # a CUDA build without a GPU is fine, with a note
    assert "CPU build would do" in doctor.check_torch("2.13.0", "12.6", "2.13.0", nvidia_gpus=0).detail


def test_torch_install_fix_by_platform():
    """Linux without an NVIDIA GPU gets the CPU index (PyPI's Linux wheel bundles CUDA); macOS wheels on PyPI are
    CPU builds; with an NVIDIA GPU the plain PyPI wheel is the right one."""
    assert "--index-url https://download.pytorch.org/whl/cpu" in doctor.torch_install_fix("2.13.0", 0, "linux")
    for fix in (doctor.torch_install_fix("2.13.0", 0, "darwin"), doctor.torch_install_fix("2.13.0", 4, "linux")):
        assert fix.startswith("pip install torch==2.13.0 (") and "whl/cpu" not in fix, fix


def fake_nvidia_smi(folder: Path, output: str, code: int = 0) -> dict[str, str]:
    """An `nvidia-smi` program on PATH that prints what the real one prints for --query-gpu: the doctor asks the
    driver this way without torch. Returns the environment with it first on PATH."""
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {code}\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_nvidia_smi_is_read_without_torch(tmp_path, monkeypatch):
    env = fake_nvidia_smi(tmp_path, "NVIDIA H200, 143771\nNVIDIA H200, 143771\n")
    monkeypatch.setenv("PATH", env["PATH"])
    assert doctor._nvidia_smi() == [("NVIDIA H200", 143771 * 2**20)] * 2
    # torch here sees no GPU (the CPU build): the gpus row says the two disagree, and the torch row wants CUDA
    row = doctor.check_gpus()
    assert_problem(row, WARN, "nvidia-smi sees 2 GPU(s) but torch sees none", "CUDA build")
    assert len(row.data["driver_gpus"]) == 2
    torch_row = doctor.check_torch()
    assert torch_row.data["nvidia_gpus"] == 2 and "whl/cpu" not in torch_row.fix
    # a CPU build beside two GPUs is a warning; PyPI's CUDA build (a matrix venv) is what those GPUs want
    assert torch_row.status == (WARN if torch_row.data["cuda"] is None else OK), torch_row
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed", code=9)["PATH"])
    assert doctor._nvidia_smi() is None  # no working driver: as if absent


@pytest.mark.timeout(60)
def test_doctor_runs_without_torch(tmp_path):
    """A fresh venv with nothing in it (no torch, no JupyterLab): `python -m zeroedu doctor` still runs, says what
    is missing with the fix, and exits 1. `import zeroedu` works there and the API names explain themselves."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=50)
    py = str(venv / "bin" / "python")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    proc = subprocess.run([py, "-m", "zeroedu", "doctor", "--json", "--nvme-path", str(tmp_path / "nvme")],
                          capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    rows = {c["check"]: c for c in report["checks"]}
    assert report["ok"] is False and "torch" in report["verdict"]
    assert rows["python"]["status"] == HERE_PYTHON_STATUS
    assert rows["torch"]["status"] == FAIL and "No module named 'torch'" in rows["torch"]["detail"]
    if sys.platform.startswith("linux"):
        assert "--index-url https://download.pytorch.org/whl/cpu" in rows["torch"]["fix"]
    assert rows["gloo"]["detail"] == "not tried: torch is not installed"
    assert rows["ranks"]["status"] == FAIL and "not tried" in rows["ranks"]["detail"]
    assert rows["loopback"]["status"] == OK  # a plain socket still proves loopback works
    assert rows["packages"]["status"] == FAIL and "missing numpy" in rows["packages"]["detail"]
    assert rows["jupyterlab"]["status"] == FAIL and rows["widgets"]["status"] == FAIL
    api = subprocess.run([py, "-c", "import zeroedu\ntry:\n    zeroedu.launch\nexcept ImportError as e:\n    print(e)"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert api.returncode == 0 and "zeroedu.launch: zeroedu needs torch" in api.stdout, api.stdout + api.stderr


def test_gloo():
    assert doctor.check_gloo().status == OK
    assert_problem(doctor.check_gloo(available=False), FAIL, "gloo")


def test_gpus():
    import torch

    real = doctor.check_gpus()
    assert real.status in (OK, WARN)
    assert len(real.data["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    none = doctor.check_gpus(devices=[], nccl=False)
    assert none.status == OK and "gloo" in none.detail
    four = doctor.check_gpus(devices=[("NVIDIA H200", 141 * GiB)] * 4, nccl=True)
    assert four.status == OK and "4 GPU(s)" in four.detail and "141.0 GB" in four.detail
    assert "one GPU per rank" in four.detail and "scripts/gpu_check.sh" in four.detail
    one = doctor.check_gpus(devices=[("NVIDIA T4", 16 * GiB)], nccl=True)
    assert "4 ranks use gloo" in one.detail and "world_size <= 1 uses NCCL" in one.detail
    assert_problem(doctor.check_gpus(devices=[("NVIDIA T4", 16 * GiB)], nccl=False), WARN, "NCCL")
    assert_problem(doctor.check_gpus(devices=[], nccl=True, driver_gpus=[("NVIDIA T4", 16 * GiB)]), WARN,
                   "torch sees none")


# -- resources ---------------------------------------------------------------------------------------------------

def test_cores():
    real = doctor.check_cores()
    assert real.data["cores"] == len(os.sched_getaffinity(0))
    assert doctor.check_cores(2).status == OK  # the machine the course is written on
    assert doctor.check_cores(8).status == OK
    assert_problem(doctor.check_cores(1), WARN, "2 cores")


def meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_memory():
    # the doctor's stated assumption: 4 ranks x 0.5 GB + 0.75 GB for the kernel and JupyterLab; 4 GB comfortable
    need = int((4 * 0.5 + 0.75) * GiB)
    real = doctor.check_memory()
    assert abs(real.data["available_bytes"] - meminfo_available()) < 0.1 * meminfo_available()
    assert real.data["needed_bytes"] == need
    assert_problem(doctor.check_memory(available_bytes=1 << 28), FAIL, "0.2 GB available", "4 GB")
    assert doctor.check_memory(available_bytes=need - 1).status == FAIL
    assert doctor.check_memory(available_bytes=need).status == WARN
    assert doctor.check_memory(available_bytes=4 * GiB).status == OK
    # 2.2 GB leaves room for 2 ranks after the notebook: the fix says so
    assert "world_size <= 2" in doctor.check_memory(available_bytes=int(2.2 * GiB)).fix
    assert doctor.check_memory(available_bytes=2 * GiB, world_size=2).status == WARN  # 1.75 GB needed


def test_disk(tmp_path):
    real = doctor.check_disk(str(tmp_path))
    assert real.status in (OK, WARN), real
    assert abs(real.data["free_bytes"] - shutil.disk_usage(tmp_path).free) < 256 * 2**20
    assert real.data["write_mb_per_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe cleans up after itself
    # a folder that does not exist yet (the engine creates it): checked, then removed again
    deep = tmp_path / "nvme" / "deeper"
    assert doctor.check_disk(str(deep)).status in (OK, WARN)
    assert not (tmp_path / "nvme").exists()
    assert_problem(doctor.check_disk(str(tmp_path), free_bytes=1 << 20), FAIL, "1 MB free", "nvme_path")
    assert doctor.check_disk(str(tmp_path), free_bytes=512 * 2**20, probe_mb=0).status == WARN
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    assert_problem(doctor.check_disk(str(a_file / "nvme")), FAIL, "cannot write", "nvme_path")


def test_loopback():
    real = doctor.check_loopback()
    assert real.status == OK, real
    assert real.data["host"] == "127.0.0.1"
    # 192.0.2.1 is TEST-NET-1, assigned to no interface here: binding fails at once and nothing is sent
    assert_problem(doctor.check_loopback(host="192.0.2.1"), FAIL, "cannot listen on 192.0.2.1", "loopback")


# -- ranks -------------------------------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_ranks_real_all_reduce():
    result = doctor.check_ranks(world_size=2)
    assert result.status in (OK, WARN), result
    assert result.data["backend"] == "gloo"
    assert result.data["expected_sum"] == 1 + 2
    assert "sum = 3 on every rank" in result.detail
    assert result.data["rank_rss_bytes"] > 50 * 2**20  # a rank with torch imported is tens of MB at least


def probe_that_raises(rank: int, world_size: int) -> dict:
    if rank == 1:
        raise RuntimeError("rank 1 breaks on purpose")
    return doctor._allreduce_probe(rank, world_size)


def probe_with_wrong_sums(rank: int, world_size: int) -> dict:
    """Real ranks, but each reports its own value instead of all-reducing: what a broken collective looks like."""
    return {"backend": "gloo", "sums": [[float(rank + 1)] * 4], "seconds": [0.001], "rss_bytes": 0}


@pytest.mark.timeout(90)
def test_ranks_failures_are_reported():
    raised = doctor.check_ranks(world_size=2, probe=probe_that_raises, timeout=30)
    assert_problem(raised, FAIL, "RankError", "rank 1", "docs/instructors.md")
    wrong = doctor.check_ranks(world_size=2, probe=probe_with_wrong_sums, timeout=30)
    assert_problem(wrong, FAIL, "should sum to 3", "rank(s) [0, 1]")


# -- course software ---------------------------------------------------------------------------------------------

def test_packages():
    real = doctor.check_packages()
    assert real.status == OK, real
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert len(real.data["installed"]) == len(project["dependencies"]) - 1  # torch has its own row
    assert_problem(doctor.check_packages(["numpy<1"]), FAIL, "numpy", "needs <1", "pip install")
    assert_problem(doctor.check_packages(["zeroedu-no-such-package>=1"]), FAIL, "missing zeroedu-no-such-package")


def test_jupyterlab_and_nbval():
    assert doctor.check_jupyterlab().status == OK
    assert_problem(doctor.check_jupyterlab("3.6.7"), WARN, "4.x", "jupyterlab>=4.2")
    nbval = doctor.check_nbval()
    assert nbval.status == OK and "--nbval notebooks" in nbval.detail


def test_widgets_extension(tmp_path):
    from jupyter_core.paths import jupyter_path
    from jupyterlab_server.config import get_federated_extensions

    real = doctor.check_widgets()
    assert real.status == OK, real
    # JupyterLab's own loader (what `jupyter labextension list` and the page use) finds the same extension
    found = get_federated_extensions(jupyter_path("labextensions"))
    assert real.data["version"] == found["@jupyter-widgets/jupyterlab-manager"]["version"]
    assert_problem(doctor.check_widgets([str(tmp_path)]), FAIL, "plain text", "ipywidgets")


# -- the command -------------------------------------------------------------------------------------------------

def test_verdict():
    good = [Result("a", OK, "fine"), Result("b", WARN, "meh", "do x")]
    assert doctor.verdict(good) == (True, "READY: this machine can run the course (1 warning(s): b).")
    ok, line = doctor.verdict(good + [Result("c", FAIL, "broken", "do y")])
    assert not ok and "NOT READY" in line and "c" in line


@pytest.mark.timeout(120)
def test_main_json_on_this_machine(capsys):
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["verdict"].startswith("READY")
    rows = {c["check"]: c for c in report["checks"]}
    assert set(rows) == {"python", "torch", "gloo", "gpus", "packages", "cores", "memory", "nvme disk", "loopback",
                         "sandbox", "ranks", "jupyterlab", "widgets", "nbval"}
    assert all(c["status"] in (OK, WARN, FAIL) for c in rows.values())
    assert all(c["fix"] for c in rows.values() if c["status"] != OK)
    assert rows["ranks"]["data"]["world_size"] == 4 and rows["ranks"]["data"]["expected_sum"] == 10


@pytest.mark.timeout(120)
def test_cli_table_and_exit_status(tmp_path):
    """`zeroedu doctor` as a learner types it; an unusable nvme path is a FAIL and a non-zero exit."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    proc = subprocess.run([str(BIN / "zeroedu"), "doctor", "--world-size", "2", "--nvme-path", str(a_file / "nvme")],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail", "fix"]
    assert any(line.startswith("nvme disk") and " FAIL " in line for line in lines), proc.stdout
    # ranks ran (ok, or warn when a busy machine made them slow)
    assert any(line.startswith("ranks") and (" ok " in line or " warn " in line) for line in lines), proc.stdout
    assert lines[-1] == "verdict: NOT READY: the course cannot run here until these are fixed: nvme disk."
