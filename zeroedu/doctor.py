"""`zeroedu doctor`: can this machine run the course? Each check says ok / warn / FAIL and, for a problem, the fix.

Every check is a small function that returns a `Result`. Its inputs default to what this machine has, and a test
(or an instructor wondering "what if") can pass others: `check_memory(available_bytes=1 << 28)` is a FAIL with a fix.
Only FAIL rows make the exit status non-zero: they mean some part of the course cannot run here. warn rows mean it
runs, slower or with a piece missing that only instructors need.

What the course needs, and why (the numbers the checks compare against):
- 4 gloo ranks, the largest world size the notebooks use. launch() counts about 0.5 GB per rank process
  (torch + gloo + a tiny model; well above what a bare rank measures, docs/benchmarks.md), plus ~0.75 GB for
  the notebook kernel (torch, matplotlib) and the JupyterLab server: 2.75 GB in all; 4 GB is comfortable.
- 2 cores: 4 ranks on 2 cores work (the course is written on such a machine); 1 core works, slowly.
- NVMe offload demos write a few MB of optimizer state to the nvme path; 1 GB free leaves room for checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from itertools import zip_longest
from pathlib import Path
from typing import Any

from zeroedu import compat
from zeroedu.fmt import fmt_bytes
from zeroedu.sysinfo import available_memory, usable_cores

__all__ = ["Result", "check_cores", "check_disk", "check_gloo", "check_gpus", "check_jupyterlab", "check_loopback",
           "check_memory", "check_nbval", "check_packages", "check_python", "check_ranks", "check_torch",
           "check_widgets", "main", "run_checks", "torch_install_fix", "verdict"]

OK, WARN, FAIL = "ok", "warn", "FAIL"

PYTHON = compat.TESTED_PYTHON[0]   # the tested default (environment.yml's python=3.11)
WORLD_SIZE = 4                      # the largest world size the notebooks launch
RANK_GB = 0.5                       # per rank process: the estimate launch() itself refuses to start beyond
NOTEBOOK_GB = 0.75                  # notebook kernel with torch and matplotlib, plus the JupyterLab server
MEMORY_COMFORT_GB = 4.0
DISK_MIN_MB = 200                   # nvme offload demos plus a sharded checkpoint of the tiny models
DISK_COMFORT_MB = 1024
DISK_PROBE_MB = 16                  # written, fsynced, read back and removed to prove the path works
RANK_START_SLOW_S = 20.0            # several times a normal start of 4 ranks on 2 cores (docs/benchmarks.md)
WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
VENV_PY = ".venv/bin/python"

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Result:
    """One row of the doctor's table. `data` holds the numbers behind `detail` for --json."""

    check: str
    status: str                      # "ok" | "warn" | "FAIL"
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def _gb(n: float) -> str:   # binary gigabytes, as free -h and the OS report memory
    return fmt_bytes(n, "GiB", 1, label="GB", grouping=False)


def _mb(n: float) -> str:
    return fmt_bytes(n, "MiB", 0, label="MB", grouping=False)


# -- the pins: pyproject.toml in a source checkout, else the installed package's metadata -----------------------

def _requirements() -> list[str]:
    """zeroedu's runtime requirements as PEP 508 strings ("torch==2.13.0", ...)."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib  # Python 3.11+; on an older Python the python row says what to do, so read metadata
    except ImportError:
        tomllib = None
    if pyproject.is_file() and tomllib is not None:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "zeroedu":
            return list(project.get("dependencies", []))
    try:  # installed from a wheel: no pyproject.toml next to the package
        return [r for r in metadata.requires("zeroedu") or [] if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        return []


def _torch_pin(requirements: Sequence[str] | None = None) -> str:
    """The torch the course is tested with and `make` installs (pyproject's [tool.zeroedu] tested-torch). The
    package accepts a range (compat.TORCH_RANGE); `requirements` is kept for callers that passed one."""
    return compat.TORCH_DEFAULT


_release = compat.release


# -- the checks --------------------------------------------------------------------------------------------------

def _tested_pythons() -> str:
    return ", ".join(f"{a}.{b}" for a, b in compat.TESTED_PYTHON)


def check_python(version_info: Sequence[int] | None = None, executable: str | None = None) -> Result:
    """In zeroedu's range (compat.PYTHON_RANGE): ok where tested here, warn where only supported; else FAIL."""
    v = tuple(sys.version_info[:3] if version_info is None else version_info)
    exe = sys.executable if executable is None else executable
    text = ".".join(map(str, v))
    data = {"version": text, "executable": exe, "range": compat.PYTHON_RANGE, "tested": _tested_pythons()}
    problem = compat.python_problem(v)
    if problem:
        found, _, fix = problem.partition(" Fix: ")
        return Result("python", FAIL, found, fix + ", or `conda env create -f environment.yml`", data)
    if tuple(v[:2]) in compat.TESTED_PYTHON:
        return Result("python", OK, f"{text} ({exe}); tested here, in the range {compat.PYTHON_RANGE}", data=data)
    return Result("python", WARN, f"{text} ({exe}) is in zeroedu's range {compat.PYTHON_RANGE} but not among the "
                  f"tested Pythons ({_tested_pythons()}): it should work", "to run exactly what is tested: "
                  "`make PY=python3.11 tour` (or conda env create -f environment.yml)", data)


def _nvidia_smi() -> list[tuple[str, int]] | None:
    """GPUs the NVIDIA driver sees, asked without torch: [(name, memory bytes)]; None where nvidia-smi is absent
    or does not answer (no NVIDIA driver: every Mac, most laptops)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), int(float(mib)) * 2**20))
        except ValueError:
            continue
    return gpus


def torch_install_fix(pin: str, nvidia_gpus: int, platform_name: str | None = None) -> str:
    """How to install the pinned torch here: the CPU build unless an NVIDIA GPU is there to use."""
    platform_name = sys.platform if platform_name is None else platform_name
    if nvidia_gpus:
        return f"pip install torch=={pin} (PyPI's Linux wheel is the CUDA build that uses the GPU)"
    if platform_name == "darwin":
        return f"pip install torch=={pin} (macOS wheels are CPU builds)"
    return (f"pip install torch=={pin} --index-url {CPU_INDEX} (the CPU build; a plain `pip install torch` on Linux "
            "pulls a CUDA build of several GB), or `make .venv/.installed` in the course folder")


def check_torch(version: str | None = None, cuda: str | None = None, pin: str | None = None,
                nvidia_gpus: int | None = None) -> Result:
    """version/cuda default to the installed torch (cuda None = CPU build); pin (the tested default) to pyproject's;
    nvidia_gpus to what nvidia-smi sees (it picks the build the fix recommends). Outside compat.TORCH_RANGE: FAIL;
    in it but not among compat.TESTED_TORCH: warn (it should run; the saved outputs were made with the pin)."""
    pin = _torch_pin() if pin is None else pin
    if nvidia_gpus is None:
        nvidia_gpus = len(_nvidia_smi() or [])
    if version is None:
        try:
            import torch
        except ImportError as e:
            return Result("torch", FAIL, f"not importable: {e}", torch_install_fix(pin, nvidia_gpus),
                          {"pin": pin, "nvidia_gpus": nvidia_gpus, "range": compat.TORCH_RANGE})
        version, cuda = torch.__version__, torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU build"
    tested = ", ".join(compat.TESTED_TORCH)
    data = {"version": version, "pin": pin, "cuda": cuda, "nvidia_gpus": nvidia_gpus, "range": compat.TORCH_RANGE,
            "tested": tested}
    fix = ((f"pip install torch=={pin}" if cuda else torch_install_fix(pin, nvidia_gpus))
           + " (into the course's environment)")
    problem = compat.torch_problem(version)
    if problem:
        return Result("torch", FAIL, f"{problem.partition(' Fix: ')[0]} ({build})", fix, data)
    if not any(_release(version)[:3] == _release(t) for t in compat.TESTED_TORCH):
        return Result("torch", WARN, f"{version}, {build}: in zeroedu's range {compat.TORCH_RANGE} but not among the "
                      f"tested versions ({tested}); it should run, and the notebooks' saved outputs were made with "
                      f"torch=={pin}", "nothing to do to learn; to run exactly what is tested: " + fix, data)
    if nvidia_gpus and not cuda:
        return Result("torch", WARN, f"{version}, {build}, but nvidia-smi sees {nvidia_gpus} NVIDIA GPU(s): the "
                      "course runs on the CPU and the GPU path (NCCL, CUDA memory, pinned offload) goes unused",
                      torch_install_fix(pin, nvidia_gpus), data)
    note = " (no NVIDIA GPU here: the CPU build would do, and is much smaller)" if cuda and not nvidia_gpus else ""
    return Result("torch", OK, f"{version}, {build}{note}; tested here (range {compat.TORCH_RANGE})", data=data)


def _torch_distributed():
    """torch.distributed, or None when torch itself is missing (the torch row says how to install it)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist


def check_gloo(available: bool | None = None) -> Result:
    if available is None:
        dist = _torch_distributed()
        if dist is None:
            return Result("gloo", FAIL, "not tried: torch is not installed", "install torch first (the torch row)")
        available = dist.is_available() and dist.is_gloo_available()
    if available:
        return Result("gloo", OK, "torch.distributed with the gloo backend (CPU collectives)")
    return Result("gloo", FAIL, "this torch has no gloo backend: no rank can talk to another",
                  "install an official torch wheel (pip or conda-forge); builds without USE_DISTRIBUTED lack gloo")


def check_gpus(devices: Sequence[tuple[str, int]] | None = None, nccl: bool | None = None,
               driver_gpus: Sequence[tuple[str, int]] | None = None) -> Result:
    """devices: (name, total memory bytes) per GPU torch sees; driver_gpus: those nvidia-smi sees (defaults: this
    machine). No GPU is fine: the course runs on gloo."""
    if driver_gpus is None and devices is None:
        driver_gpus = _nvidia_smi() or []
    driver_gpus = list(driver_gpus or [])
    if devices is None or nccl is None:
        dist = _torch_distributed()
        if dist is None:
            seen = ", ".join(f"{n} {_gb(m)}" for n, m in driver_gpus)
            return Result("gpus", OK if not driver_gpus else WARN,
                          (f"nvidia-smi sees {len(driver_gpus)} GPU(s): {seen}; " if driver_gpus else
                           "no NVIDIA GPU seen; ") + "torch is not installed, so NCCL is not known",
                          "install torch first (the torch row)" if driver_gpus else "",
                          {"gpus": [], "driver_gpus": [{"name": n, "memory_bytes": m} for n, m in driver_gpus],
                           "nccl": None})
        import torch

        found = ([(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
                  for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
        devices = found if devices is None else devices
        nccl = (dist.is_available() and dist.is_nccl_available()) if nccl is None else nccl
    data = {"gpus": [{"name": n, "memory_bytes": m} for n, m in devices], "nccl": nccl,
            "driver_gpus": [{"name": n, "memory_bytes": m} for n, m in driver_gpus]}
    if not devices:
        has = "available" if nccl else "not in this build"
        if driver_gpus:
            return Result("gpus", WARN, f"nvidia-smi sees {len(driver_gpus)} GPU(s) but torch sees none (a CPU "
                          f"build, or a driver too old for this torch's CUDA); the course runs on CPU with gloo",
                          "install the CUDA build: pip install torch==<pin> (PyPI's Linux wheel), and check "
                          "nvidia-smi's driver version against the CUDA version torch reports", data)
        return Result("gpus", OK, f"none visible; the course runs on CPU with gloo (NCCL {has})", data=data)
    names = ", ".join(f"{n} {_gb(m)}" for n, m in devices)
    if not nccl:
        return Result("gpus", WARN, f"{len(devices)} GPU(s) ({names}) but this torch has no NCCL: ranks use gloo",
                      "install a CUDA build of the pinned torch (pip install torch==<pin>) to use NCCL", data)
    per_rank = ("one GPU per rank" if len(devices) >= WORLD_SIZE
                else f"{len(devices)} < {WORLD_SIZE}: 4 ranks use gloo; world_size <= {len(devices)} uses NCCL")
    return Result("gpus", OK, f"{len(devices)} GPU(s): {names}; NCCL available ({per_rank}); "
                  "GPU checks: scripts/gpu_check.sh", data=data)


def check_cores(cores: int | None = None) -> Result:
    cores = usable_cores() if cores is None else cores
    data = {"cores": cores, "world_size": WORLD_SIZE}
    if cores >= WORLD_SIZE:
        return Result("cores", OK, f"{cores} usable: one per rank for {WORLD_SIZE} ranks", data=data)
    if cores >= 2:
        return Result("cores", OK, f"{cores} usable: {WORLD_SIZE} ranks share them (fine; timings are noisier)",
                      data=data)
    return Result("cores", WARN, f"{cores} usable: {WORLD_SIZE} ranks take turns on one core, demos run slowly",
                  "give the machine (VM, container: --cpus) at least 2 cores", data)


def check_memory(available_bytes: int | None = None, world_size: int = WORLD_SIZE) -> Result:
    available = available_memory() if available_bytes is None else available_bytes
    need = (world_size * RANK_GB + NOTEBOOK_GB) * 2**30
    assumed = f"{world_size} ranks x {RANK_GB} GB + {NOTEBOOK_GB} GB notebook and JupyterLab = {need / 2**30:.2f} GB"
    data = {"available_bytes": available, "needed_bytes": int(need),
            "comfortable_bytes": int(MEMORY_COMFORT_GB * 2**30)}
    if available is None:
        return Result("memory", WARN, f"could not read available memory; the course needs {assumed}",
                      "check free memory by hand (free -h)", data)
    if available < need:
        fits = int((available - NOTEBOOK_GB * 2**30) // (RANK_GB * 2**30))
        fewer = (f"; until then world_size <= {fits} may run" if 1 <= fits < world_size else "")
        return Result("memory", FAIL, f"{_gb(available)} available, the course needs {assumed}",
                      f"close other programs or give the machine (VM, container: --memory) at least "
                      f"{MEMORY_COMFORT_GB:.0f} GB{fewer}", data)
    if available < MEMORY_COMFORT_GB * 2**30:
        return Result("memory", WARN, f"{_gb(available)} available: enough ({assumed}) but tight",
                      f"close other programs; {MEMORY_COMFORT_GB:.0f} GB leaves room for the browser and plots", data)
    return Result("memory", OK, f"{_gb(available)} available; needs {assumed}", data=data)


def check_disk(path: str | None = None, free_bytes: int | None = None, probe_mb: int = DISK_PROBE_MB) -> Result:
    """Free space at the nvme offload path, and that a file can be written, fsynced and read back there."""
    path = str(Path(path or tempfile.gettempdir()).expanduser())
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:  # the engine creates the folder: check its parent
        existing = existing.parent
    data: dict[str, Any] = {"path": path}
    fix_path = "pass a writable folder on a local disk as offload_optimizer.nvme_path (and to doctor --nvme-path)"
    if free_bytes is None:
        try:
            free_bytes = shutil.disk_usage(existing).free
        except OSError as e:
            return Result("nvme disk", FAIL, f"{path}: {e}", fix_path, data)
    data["free_bytes"] = free_bytes
    if free_bytes < DISK_MIN_MB * 2**20:
        return Result("nvme disk", FAIL, f"{_mb(free_bytes)} free at {path}; offload and checkpoint "
                      f"notebooks need {DISK_MIN_MB} MB", f"free disk space there, or {fix_path}", data)
    if probe_mb:
        try:
            seconds = _disk_probe(path, probe_mb)
        except OSError as e:
            return Result("nvme disk", FAIL, f"cannot write to {path}: {e.strerror or e}", fix_path, data)
        data["write_mb_per_s"] = round(probe_mb / seconds, 1)
    speed = f", writes {data['write_mb_per_s']:.0f} MB/s (fsync)" if "write_mb_per_s" in data else ""
    if free_bytes < DISK_COMFORT_MB * 2**20:
        return Result("nvme disk", WARN, f"{_mb(free_bytes)} free at {path}{speed}: enough for the demos",
                      f"free up to {DISK_COMFORT_MB} MB for room to experiment", data)
    return Result("nvme disk", OK, f"{_gb(free_bytes)} free at {path}{speed}", data=data)


def _disk_probe(path: str, mb: int) -> float:
    """Seconds to write mb MiB, fsync and read them back in a scratch folder under path (created if needed)."""
    top = Path(path)  # the outermost folder this probe creates, removed again afterwards
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    created = not top.exists()
    os.makedirs(path, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="zeroedu-doctor-", dir=path) as scratch:
            block = os.urandom(2**20)
            probe = os.path.join(scratch, "probe.bin")
            t0 = time.perf_counter()
            with open(probe, "wb") as f:
                for _ in range(mb):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            seconds = time.perf_counter() - t0
            with open(probe, "rb") as f:
                if f.read(2**20) != block:
                    raise OSError(0, "data read back differs from data written")
    finally:
        if created:
            shutil.rmtree(top, ignore_errors=True)
    return max(seconds, 1e-6)


def check_loopback(host: str = "127.0.0.1", timeout: float = 5.0) -> Result:
    """TCP on loopback, which gloo's transport uses between ranks (launch() pins gloo to the loopback interface;
    the ranks meet through a FileStore in the run's 0700 folder): a TCPStore bound to loopback, joined by a
    client, one key set and read."""
    fix = (f"allow TCP on {host} (loopback) in the firewall or sandbox; zeroedu listens on no other address")
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(8)
    except OSError as e:
        return Result("loopback", FAIL, f"cannot listen on {host}: {e.strerror or e}", fix, {"host": host})
    port = sock.getsockname()[1]
    try:
        from datetime import timedelta

        import torch.distributed as dist
    except ImportError:  # no torch: a plain connect still tells whether loopback works
        with sock, socket.create_connection((host, port), timeout=timeout):
            pass
        return Result("loopback", OK, f"TCP on {host}:{port} works (torch absent: store not tried)",
                      data={"host": host})
    t0 = time.perf_counter()
    try:
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout), master_listen_fd=sock.detach())
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        client.set("zeroedu-doctor", "ping")
        answer = server.get("zeroedu-doctor")
    except Exception as e:  # the store raises RuntimeError/DistStoreError with the OS reason in the text
        return Result("loopback", FAIL, f"rendezvous store on {host}:{port} failed: {str(e).splitlines()[0]}", fix,
                      {"host": host, "port": port})
    finally:
        sock.close()
    ms = (time.perf_counter() - t0) * 1000
    if answer != b"ping":
        return Result("loopback", FAIL, f"store on {host}:{port} returned {answer!r} instead of b'ping'", fix)
    return Result("loopback", OK, f"TCP store on {host}:{port}: set/get in {ms:.0f} ms (gloo connects over loopback; "
                  "launch()'s ranks rendezvous through a FileStore in their 0700 run folder, which no other user can "
                  "open)",
                  data={"host": host, "port": port, "ms": round(ms, 1)})


def _allreduce_probe(rank: int, world_size: int) -> dict[str, Any]:
    """Runs on every rank: all_reduce (rank + 1) and time a few rounds; the parent checks the sum."""
    import torch
    import torch.distributed as dist

    # NCCL (launch picks it when every rank has a GPU) reduces CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    sums, seconds = [], []
    for _ in range(5):
        t = torch.full((1024,), float(rank + 1), device=device)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()  # NCCL returns before the GPU is done
        seconds.append(time.perf_counter() - t0)
        sums.append(t.tolist())
    rss = 0
    try:
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        pass
    return {"backend": dist.get_backend(), "sums": sums, "seconds": seconds, "rss_bytes": rss}


def check_ranks(world_size: int = WORLD_SIZE, probe: Callable[[int, int], Any] = _allreduce_probe,
                timeout: float = 60.0) -> Result:
    """Start world_size ranks with zeroedu.launch, all_reduce, and compare with the closed form n(n+1)/2."""
    fix_generic = ("run `zeroedu doctor` again; if it persists, see docs/instructors.md (known failure modes): "
                   "a blocked loopback port, too little memory, or a stuck rank")
    try:
        from zeroedu.launch import LaunchError, launch
    except ImportError as e:
        return Result("ranks", FAIL, f"zeroedu.launch not importable: {e}", "fix the torch row above first")
    t0 = time.perf_counter()
    try:
        results = launch(probe, world_size=world_size, timeout=timeout, hang_timeout=min(30.0, timeout))
    except LaunchError as e:
        first = str(e).strip().splitlines()[0]
        return Result("ranks", FAIL, f"{world_size} ranks did not complete: {type(e).__name__}: {first}",
                      fix_generic, {"world_size": world_size, "error": str(e)})
    except Exception as e:  # anything else launch lets through is a bug worth seeing in full
        return Result("ranks", FAIL, f"{world_size} ranks: {type(e).__name__}: {e}", fix_generic,
                      {"world_size": world_size})
    wall = time.perf_counter() - t0
    expected = world_size * (world_size + 1) / 2
    wrong = [r for r, res in enumerate(results)
             if not isinstance(res, dict) or any(v != expected for s in res.get("sums", [[None]]) for v in s)]
    data = {"world_size": world_size, "start_and_run_s": round(wall, 2), "expected_sum": expected}
    if wrong:
        return Result("ranks", FAIL, f"all_reduce of rank+1 over {world_size} ranks should sum to {expected:g} "
                      f"everywhere; rank(s) {wrong} got something else", "report this with `zeroedu doctor --json` "
                      "output: the collectives of this torch build are broken here", data)
    per_op = sorted(s for res in results for s in res["seconds"][1:] or res["seconds"])  # first round warms up
    median_ms = per_op[len(per_op) // 2] * 1000
    rss = max(res["rss_bytes"] for res in results)
    data.update(backend=results[0]["backend"], all_reduce_median_ms=round(median_ms, 2), rank_rss_bytes=rss)
    detail = (f"{world_size} {results[0]['backend']} ranks started and all_reduced in {wall:.1f} s; sum = "
              f"{expected:g} on every rank; all_reduce(4 KB) median {median_ms:.1f} ms; rank RSS {_mb(rss)}")
    if wall > RANK_START_SLOW_S:
        return Result("ranks", WARN, detail + f" (slow: > {RANK_START_SLOW_S:.0f} s)",
                      "the machine is busy or short of cores: close other programs", data)
    return Result("ranks", OK, detail, data=data)


def check_packages(requirements: Sequence[str] | None = None) -> Result:
    """Every runtime dependency of zeroedu (torch has its own row) is installed in a version the pins allow."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None  # noqa: N806 -- packaging comes with JupyterLab; without it, check presence only
    reqs = list(_requirements() if requirements is None else requirements)
    missing, wrong, seen, to_install = [], [], [], []
    for text in reqs:
        name = text.split(";")[0].strip()
        spec = None
        if Requirement is not None:
            req = Requirement(text)
            name, spec = req.name, req.specifier
        else:
            name = name.split("=")[0].split("<")[0].split(">")[0].split("!")[0].split("~")[0].strip()
        if name.lower() == "torch" and requirements is None:
            continue
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(text)
            to_install.append(text)
            continue
        if spec is not None and not spec.contains(version, prereleases=True):
            wrong.append(f"{name} {version} (needs {spec})")
            to_install.append(text)
        else:
            seen.append(f"{name} {version}")
    data = {"installed": seen, "missing": missing, "wrong_version": wrong}
    if missing or wrong:
        problems = "; ".join([f"missing {m}" for m in missing] + wrong)
        quoted = " ".join(f"'{r}'" for r in to_install)
        return Result("packages", FAIL, problems, f"pip install -e . from the course folder (or pip install {quoted})",
                      data)
    if not reqs:
        return Result("packages", WARN, "zeroedu's requirements not found (no pyproject.toml, not installed)",
                      "install the course with `pip install -e .` from its folder", data)
    return Result("packages", OK, f"{len(seen)} pinned dependencies present in allowed versions", data=data)


def check_jupyterlab(version: str | None = None) -> Result:
    if version is None:
        try:
            version = metadata.version("jupyterlab")
        except metadata.PackageNotFoundError:
            return Result("jupyterlab", FAIL, "JupyterLab is not installed in this environment",
                          "pip install 'jupyterlab>=4.2,<5' (or make .venv/.installed)")
    if _release(version)[:1] != (4,):
        return Result("jupyterlab", WARN, f"JupyterLab {version}; the course is tested with 4.x",
                      "pip install 'jupyterlab>=4.2,<5'", {"version": version})
    return Result("jupyterlab", OK, f"JupyterLab {version}", data={"version": version})


def check_widgets(labextension_dirs: Sequence[str] | None = None) -> Result:
    """ipywidgets render in JupyterLab only if the jupyterlab-manager lab extension is where JupyterLab looks."""
    fix = "pip install 'ipywidgets>=8.1,<9' (it brings jupyterlab_widgets), then restart JupyterLab and reload the page"
    if labextension_dirs is None:
        try:
            import jupyterlab_widgets  # noqa: F401 -- the package that ships the lab extension
            from jupyter_core.paths import jupyter_path
        except ImportError as e:
            return Result("widgets", FAIL, f"{e.name or e} is not installed: sliders would show as plain text", fix)
        labextension_dirs = jupyter_path("labextensions")
    for folder in labextension_dirs:
        package = Path(folder) / WIDGETS_EXTENSION / "package.json"
        if package.is_file():
            try:
                version = json.loads(package.read_text()).get("version", "?")
            except (OSError, ValueError):
                version = "?"
            where = package.parent.parent.parent
            return Result("widgets", OK, f"lab extension {WIDGETS_EXTENSION} {version} in {where}",
                          data={"path": str(package.parent), "version": version})
    return Result("widgets", FAIL, f"lab extension {WIDGETS_EXTENSION} not found in {', '.join(labextension_dirs)}: "
                  "sliders would show as plain text", fix, {"searched": list(labextension_dirs)})


def check_nbval(version: str | None = None) -> Result:
    if version is None:
        try:
            version = metadata.version("nbval")
        except metadata.PackageNotFoundError:
            return Result("nbval", WARN, "nbval is not installed: learners are fine, instructors cannot run the "
                          "notebook pre-flight", "pip install -e '.[test]' (or make .venv/.installed)")
    return Result("nbval", OK, f"nbval {version} (pre-flight: {VENV_PY} -m pytest --nbval notebooks)",
                  data={"version": version})


def check_sandbox(works: tuple[bool, str] | None = None) -> Result:
    """bubblewrap, which `zeroedu grade` runs every submission in. Learners do not need it (a warning)."""
    from zeroedu.grading import sandbox

    ok, why = sandbox.check() if works is None else works
    if ok:
        return Result("sandbox", OK, f"{why}: zeroedu grade runs each submission in a sandbox", data={"ok": True})
    return Result("sandbox", WARN, f"{why}: zeroedu grade refuses untrusted notebooks (learners are fine)",
                  sandbox.INSTALL_HINT, {"ok": False})


# -- running them ------------------------------------------------------------------------------------------------

def run_checks(world_size: int = WORLD_SIZE, nvme_path: str | None = None) -> list[Result]:
    results = [check_python(), check_torch(), check_gloo(), check_gpus(), check_packages(), check_cores(),
               check_memory(world_size=world_size), check_disk(nvme_path), check_loopback()]
    by_name = {r.check: r for r in results}
    blockers = [n for n in ("torch", "gloo", "loopback") if by_name[n].status == FAIL]
    if blockers:  # the rank check would only fail again, less clearly
        results.append(Result("ranks", FAIL, f"not tried: {', '.join(blockers)} failed above",
                              "fix the rows above, then run zeroedu doctor again"))
    else:
        results.append(check_ranks(world_size))
    results += [check_jupyterlab(), check_widgets(), check_nbval(), check_sandbox()]
    return results


def verdict(results: Sequence[Result]) -> tuple[bool, str]:
    fails = [r.check for r in results if r.status == FAIL]
    warns = [r.check for r in results if r.status == WARN]
    if fails:
        return False, f"NOT READY: the course cannot run here until these are fixed: {', '.join(fails)}."
    tail = f" ({len(warns)} warning(s): {', '.join(warns)})" if warns else ""
    return True, f"READY: this machine can run the course{tail}."


def _table(results: Sequence[Result], widths: tuple[int, int, int, int] = (10, 6, 58, 44)) -> str:
    rows = [("check", "status", "detail", "fix")] + [(r.check, r.status, r.detail, r.fix) for r in results]
    lines = []
    for i, row in enumerate(rows):
        cells = [textwrap.wrap(text, w, break_on_hyphens=False) or [""] for text, w in zip(row, widths, strict=True)]
        for parts in zip_longest(*cells, fillvalue=""):
            lines.append("  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroedu doctor", description="Check that this machine can run the "
                                     "course: Python, torch, gloo, GPUs, cores, memory, disk, ranks, JupyterLab.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE,
                        help=f"ranks to start in the rank check (default {WORLD_SIZE}, the course's largest)")
    parser.add_argument("--nvme-path", default=None,
                        help="folder for NVMe offload to check (default: the temp dir, "
                             f"{tempfile.gettempdir()})")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    t0 = time.perf_counter()
    results = run_checks(args.world_size, args.nvme_path)
    ok, line = verdict(results)
    if args.json:
        print(json.dumps({"ok": ok, "verdict": line, "seconds": round(time.perf_counter() - t0, 2),
                          "platform": platform.platform(), "checks": [asdict(r) for r in results]}, indent=2))
    else:
        print(_table(results))
        print(f"\nverdict: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
