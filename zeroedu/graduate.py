"""Graduating to DeepSpeed: the same training script under `import zeroedu as ds` and `import deepspeed as ds`.

Notebook 14 runs `train` below on CPU ranks twice, once per library, with the same model, data and config, and
compares what each measured. DeepSpeed runs on CPU over gloo (deepspeed.init_distributed(dist_backend="gloo")).
"""

from __future__ import annotations

import importlib


def import_deepspeed():
    """DeepSpeed, ready for CPU ranks over gloo (torch.distributed already initialized by zeroedu.launch).

    On CPU, DeepSpeed compiles a shared-memory all-reduce extension the first time its comm layer starts (minutes
    on a small machine, then cached). That kernel serves inference all-reduces only; training collectives go
    through torch.distributed (gloo here). So it is marked unavailable and not built.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def library(name: str):
    """`import zeroedu as ds` or `import deepspeed as ds`, by name."""
    if name == "deepspeed":
        return import_deepspeed()
    if name != "zeroedu":
        raise ValueError(f"library must be 'zeroedu' or 'deepspeed', got {name!r}")
    return importlib.import_module("zeroedu")
