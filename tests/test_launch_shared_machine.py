"""launch() on a shared machine (JupyterHub, a lab server): what a rank creates, only its user can open or run
(issue 36, item 8 and 7). Real ranks, real files."""

from __future__ import annotations

import os
import stat
import sys

import cloudpickle
import torch.distributed as dist

from zeroedu.launch import launch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _what_a_rank_sees(rank: int, world_size: int) -> dict:
    out_file = os.path.realpath("/proc/self/fd/1")   # launch() points the rank's stdout at rank<N>.stdout
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):         # PrefixStore(s) around the one the ranks met through
        store = store.underlying_store
    return {"stdout": out_file, "stdout_mode": stat.S_IMODE(os.stat(out_file).st_mode),
            "stderr_mode": stat.S_IMODE(os.stat(os.path.realpath("/proc/self/fd/2")).st_mode),
            "folder_mode": stat.S_IMODE(os.stat(os.path.dirname(out_file)).st_mode),
            "store": type(store).__name__}


def test_rank_logs_are_not_executable_and_the_rendezvous_is_a_private_file():
    for rank, seen in enumerate(launch(_what_a_rank_sees, 2)):
        assert seen["stdout"].endswith(f"rank{rank}.stdout"), seen
        assert seen["stdout_mode"] == 0o644 and seen["stderr_mode"] == 0o644, seen
        # Ranks meet through a file in a folder only this user can open, not a TCP store any local user can join.
        assert seen["store"] == "FileStore" and seen["folder_mode"] == 0o700, seen
