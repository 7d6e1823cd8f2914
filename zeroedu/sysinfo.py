"""What this machine offers the ranks: usable cores and free memory. No torch, so `zeroedu doctor` runs without it."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """Cores this process may use (containers, taskset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory free for new processes: Linux's MemAvailable, else (macOS) the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # macOS and others: total physical memory is the best cheap figure
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
