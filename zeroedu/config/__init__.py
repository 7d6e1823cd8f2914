"""The config: DeepSpeed's JSON, parsed into frozen dataclasses, so that real DeepSpeed configs run as written.

Every key is declared once, as a field of its section's dataclass (zeroedu.config.sections; the top level in
zeroedu.config.top), with its check and bounds, DeepSpeed 0.19.8's default, and what zeroedu does with it:
implemented, accepted with a note (it changes nothing here, and the note says why: hardware keys such as `aio` or
`pin_memory` say what they would do on a GPU machine), accepted at DeepSpeed's default only, or refused with the
reason unless switched off (pipeline, MoE, compression, 1-bit optimizers, ...). The rules follow DeepSpeed's:
its own names for a key (the stage-3 aliases) are accepted; "auto" in a section DeepSpeed parses with pydantic is
the key left out, as there; elsewhere it is the Hugging Face Trainer's placeholder, answered with the value to
write; an unknown top-level key is ignored with a note (DeepSpeed ignores it too), an unknown key inside a
section is an error naming the closest valid one. Every problem of a config is reported in one ConfigError, so a
learner fixes them all at once.

Where a default differs from DeepSpeed's, the field's `differs` says how (docs/benchmarks.md, "At the defaults",
has the table): bucket and prefetch sizes left out are sized to the model (zeroedu.stages.sizing); overlap_comm is
true at every stage; stage3_max_reuse_distance is 0 (the ZeRO paper's 3 Psi); gradient_clipping is 0 (DeepSpeed
0.19.8: 1.0, so a config that leaves it out gets a note saying so); a config without an optimizer section gets
Adam at lr 1e-3, and one without batch keys a micro-batch of 1 (DeepSpeed: no optimizer, and an error for the batch).

The `zeroedu` section holds zeroedu's own knobs that live in modules (ZeRO++ code widths and blocks, the node
size, the CPU Adam, the ledger's and timeline's limits); `Config.resolved()` is what a run used, and checkpoints
record it.

To add a key: add a field with `key(...)` to its section in zeroedu/config/sections.py (or top.py).
"""

from zeroedu.config.declare import ConfigError, Key, auto_problem, key
from zeroedu.config.sections import (
    DEEPSPEED_OPTIMIZERS,
    PIN_NOTE,
    ActivationCheckpointingConfig,
    BF16Config,
    CommsLoggerConfig,
    DataTypesConfig,
    FP16Config,
    OffloadConfig,
    OffloadParamConfig,
    OptimizerConfig,
    OptimizerParams,
    SchedulerConfig,
    ZeroConfig,
    ZeroeduConfig,
)
from zeroedu.config.top import Config, load_config

__all__ = ["DEEPSPEED_OPTIMIZERS", "PIN_NOTE", "ActivationCheckpointingConfig", "BF16Config", "CommsLoggerConfig",
           "Config", "ConfigError", "DataTypesConfig", "FP16Config", "Key", "OffloadConfig", "OffloadParamConfig",
           "OptimizerConfig", "OptimizerParams", "SchedulerConfig", "ZeroConfig", "ZeroeduConfig", "auto_problem",
           "key", "load_config"]
