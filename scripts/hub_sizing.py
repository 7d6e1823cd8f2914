"""What one learner costs a shared JupyterHub: run lessons as a learner's kernel would, and record the peak memory
and the CPU seconds of the kernel with every process it starts (the ranks included).

    python scripts/hub_sizing.py notebooks/00_start_here.ipynb notebooks/07_scaling.ipynb --json sizing.json

Read from /proc every 0.2 s (Linux only, no extra package): the peak of the summed PSS (proportional set size:
torch's shared libraries counted once across the ranks, as the kernel's cgroup sees them) and of the summed RSS
(each process counted whole, an upper bound); CPU is each process's utime + stime at its last sample, summed, so
a rank that lived less than 0.2 s can be missed (a few hundredths of a second)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _sample(pid: int) -> tuple[int, int, float] | None:
    """(rss bytes, pss bytes, cpu seconds) of one process, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        rss = pss = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
        return rss, pss, cpu
    except (OSError, IndexError, ValueError):
        return None


def measure(notebook: Path, timeout: int) -> dict:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    peak = {"rss": 0, "pss": 0, "processes": 0}
    cpu: dict[int, float] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            km = client.km
            pid = getattr(getattr(km, "provisioner", None), "pid", None) if km is not None else None
            if pid:
                rss = pss = 0
                pids = _tree(pid)
                for p in pids:
                    s = _sample(p)
                    if s is not None:
                        rss, pss, cpu[p] = rss + s[0], pss + s[1], s[2]
                peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
                peak["processes"] = max(peak["processes"], len(pids))
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        client.execute()
    finally:
        done.set()
        thread.join()
    wall = time.monotonic() - t0
    return {"notebook": notebook.name, "wall_s": round(wall, 1), "cpu_s": round(sum(cpu.values()), 1),
            "peak_pss_gb": round(peak["pss"] / 1e9, 2), "peak_rss_gb": round(peak["rss"] / 1e9, 2),
            "peak_processes": peak["processes"], "load_average": [round(x, 1) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--timeout", type=int, default=600)
    args = parser.parse_args(argv)
    rows = []
    for nb in args.notebooks:
        row = measure(nb, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
