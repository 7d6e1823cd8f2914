"""Time each notebook under nbval, one pytest run per notebook, and print a Markdown table.

    .venv/bin/python scripts/time_notebooks.py                      # notebooks/*.ipynb
    .venv/bin/python scripts/time_notebooks.py solutions/*.ipynb    # any notebooks

Wall-clock seconds of the whole run (kernel start, every cell, the comparison with the saved outputs), the
same command `make test` uses. The header shows the load average: wall time grows when other programs share
the cores. Run it on a machine of the room to compare with docs/instructors.md.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_one(notebook: Path) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", "--nbval-sanitize-with",
           str(ROOT / "tests" / "nbval_sanitize.cfg"), str(notebook)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    summary = (proc.stdout.strip().splitlines() or ["?"])[-1]
    counts = re.sub(r"\s+in [\d.]+s.*$", "", summary)
    return seconds, ("passed: " if proc.returncode == 0 else "FAILED: ") + counts


def main(argv: list[str]) -> int:
    notebooks = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.platform()}, {cores} cores, Python {platform.python_version()}, load average {load:.1f}\n")
    print("| notebook | nbval run (s) | result (cells) |\n|---|---|---|")
    failed = 0
    for nb in notebooks:
        seconds, result = time_one(nb.resolve())
        failed += result.startswith("FAILED")
        print(f"| {nb.name} | {seconds:.0f} | {result} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
