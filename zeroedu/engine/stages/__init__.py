"""One file per ZeRO stage; each adds one thing to the one before it. zeroedu.compose layers the extras on."""

from __future__ import annotations

from zeroedu.engine.stages.stage0 import Stage0
from zeroedu.engine.stages.stage1 import Stage1
from zeroedu.engine.stages.stage2 import Stage2
from zeroedu.engine.stages.stage3 import Stage3

STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}

__all__ = ["STAGES", "Stage0", "Stage1", "Stage2", "Stage3"]
