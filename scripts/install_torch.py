"""Install the tested torch (pyproject.toml [tool.zeroedu] tested-torch) into the running Python's environment, as
the build this machine can use: the CPU build unless an NVIDIA GPU is there to use. `make .venv/.installed` runs it
before the course.

Why a script: on PyPI, Linux `torch==X` is the CUDA build (several GB of CUDA libraries a laptop without an
NVIDIA GPU never uses). The CPU build has a local version, `X+cpu`, and lives on PyTorch's own index; pip
prefers it once that index is offered, because a local version sorts above the plain one.

    Linux, no nvidia-smi   the CPU build: from a source pip is already configured with (a wheel folder, a
                           mirror) if one has it, else from the CPU index (--extra-index-url, checked first
                           with a short timeout so that an unreachable index costs seconds, not minutes)
    Linux with nvidia-smi  PyPI's wheel, the CUDA build
    macOS                  PyPI's wheel, which is a CPU build there (Apple silicon)

ZEROEDU_TORCH_INDEX=URL picks the index yourself (e.g. https://download.pytorch.org/whl/cu126 for CUDA 12.6).
Usage: python scripts/install_torch.py [--dry-run]   (--dry-run: say what it would do, install nothing)
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10


def torch_requirement() -> str:
    """torch==<tested-torch>. The package itself accepts a range (pyproject's dependencies); `make` installs the
    version the notebooks' outputs were saved with. Read with a regex: tomllib is Python 3.11+, the range 3.10+."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^tested-torch\s*=\s*"([^"]+)"', text, re.MULTILINE)
    if found is None:
        raise SystemExit("install_torch: pyproject.toml has no [tool.zeroedu] tested-torch = \"X.Y.Z\"")
    return f"torch=={found.group(1)}"


def pip(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=capture, text=True)


def resolved_version(req: str, *extra: str) -> str | None:
    """The torch version pip would pick for req from the sources it is configured with (no install)."""
    proc = pip("install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet", "--report", "-", req, *extra,
               capture=True)
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout)["install"][0]["metadata"]["version"]
    except (ValueError, KeyError, IndexError):
        return None


def reachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def plan(req: str) -> tuple[list[str], str]:
    """(extra pip arguments, the reason) for installing req on this machine."""
    chosen = os.environ.get("ZEROEDU_TORCH_INDEX")
    if chosen:
        return ["--extra-index-url", chosen], f"ZEROEDU_TORCH_INDEX={chosen}"
    system = platform.system()
    if system == "Darwin":
        return [], "macOS: PyPI's wheel is a CPU build"
    if system != "Linux":
        return [], f"{system}: PyPI's wheel (the course is tested on Linux and macOS)"
    if shutil.which("nvidia-smi"):
        return [], "nvidia-smi found: PyPI's Linux wheel, the CUDA build"
    local = resolved_version(req)
    if local and local.endswith("+cpu"):
        return [], f"no NVIDIA GPU; pip's configured sources already offer the CPU build {local}"
    if reachable(f"{CPU_INDEX}/torch/"):
        return ["--extra-index-url", CPU_INDEX], f"no NVIDIA GPU: the CPU build from {CPU_INDEX}"
    return [], (f"WARNING: no NVIDIA GPU, but {CPU_INDEX} cannot be reached (tried for {PROBE_TIMEOUT_S} s): "
                "installing PyPI's wheel, a CUDA build of several GB. To avoid that, stop now (Ctrl-C) and retry "
                "when the index is reachable, or set ZEROEDU_TORCH_INDEX to a mirror of it")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    req = torch_requirement()
    extra, why = plan(req)
    print(f"install_torch: {req} ({why})", flush=True)
    if "--dry-run" in args:
        print(" ".join(["pip", "install", req, *extra]))
        return 0
    return pip("install", "--quiet", req, *extra).returncode


if __name__ == "__main__":
    sys.exit(main())
