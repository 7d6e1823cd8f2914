"""One file per ZeRO stage; each adds one thing to the one before it."""

from __future__ import annotations

from zeroedu.stages.stage0 import Stage0
from zeroedu.stages.stage1 import Stage1
from zeroedu.stages.stage2 import Stage2
from zeroedu.stages.stage3 import Stage3

STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


def engine_class(cfg) -> type:
    """The stage's class, with ZeRO++ and offload layered on when the config asks for them.

    Each feature is a mixin in its own module (zeroedu.zeropp, zeroedu.offload) that overrides a few
    methods of the stage; the class is composed here so that the stage files stay about the stage.
    """
    zc = cfg.zero_optimization
    bases: list[type] = []
    if zc.offload_optimizer.device != "none" or zc.offload_param.device != "none":
        from zeroedu.offload import OffloadMixin

        bases.append(OffloadMixin)
    if zc.zero_quantized_weights or zc.zero_quantized_gradients or zc.zero_hpz_partition_size > 1:
        from zeroedu.zeropp import ZeroPPMixin

        bases.append(ZeroPPMixin)
    stage = STAGES[cfg.stage]
    if not bases:
        return stage
    name = stage.__name__ + "".join(b.__name__.removesuffix("Mixin") for b in bases)
    return type(name, (*bases, stage), {})


__all__ = ["STAGES", "Stage0", "Stage1", "Stage2", "Stage3", "engine_class"]
