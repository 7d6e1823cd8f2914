"""initialize(), and the one place where a stage and its extras become an engine class.

Layering is one-way: zeroedu.engine (what every stage shares) <- zeroedu/engine/stages/ (one file a stage) <- the extras
(zeroedu.offload, zeroedu.zeropp), each a mixin over a stage's public hooks <- this module, which composes them.
Nothing below imports what is above it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroedu import client
from zeroedu.config import load_config
from zeroedu.engine.extras.offload import OffloadMixin
from zeroedu.engine.extras.zeropp import ZeroPPMixin
from zeroedu.engine.stages import STAGES
from zeroedu.launch import init_distributed
from zeroedu.zero import apply_leaf_module_config


def engine_class(cfg) -> type:
    """The stage's class, with ZeRO++ and offload layered on when the config asks for them.

    Each feature is a mixin in its own module (zeroedu.zeropp, zeroedu.offload) that overrides a few hooks of
    the stage (zeroedu.engine.Engine lists them); the class is composed here so that the stage files stay about
    the stage. Method resolution: offload, then ZeRO++, then the stage.
    """
    zc = cfg.zero_optimization
    bases: list[type] = []
    if zc.offload_optimizer.device != "none" or zc.offload_param.device != "none":
        bases.append(OffloadMixin)
    if zc.zero_quantized_weights or zc.zero_quantized_gradients or zc.zero_hpz_partition_size > 1:
        bases.append(ZeroPPMixin)
    stage = STAGES[cfg.stage]
    if not bases:
        return stage
    name = stage.__name__ + "".join(b.__name__.removesuffix("Mixin") for b in bases)
    return type(name, (*bases, stage), {})


def initialize(model: torch.nn.Module | None = None, config=None, model_parameters=None, optimizer=None,
               lr_scheduler=None, training_data=None, collate_fn=None, config_params=None, args=None, mpu=None,
               dist_init_required: bool | None = None):
    """Wrap `model` in the engine for `config["zero_optimization"]["stage"]`, like `deepspeed.initialize`.

    Returns `(engine, optimizer, data_loader, lr_scheduler)`, as DeepSpeed does: the data loader exists when
    `training_data` is given, the scheduler when the config has a `scheduler` section or `lr_scheduler` is given.
    DeepSpeed's client objects are honoured (zeroedu.client): `optimizer` (a torch Adam, AdamW or SGD, or a
    callable that makes one from parameters) gives the optimizer's class and hyperparameters, and the state is
    sharded as the config's optimizer would be; `lr_scheduler` (a torch scheduler over that optimizer, or a
    callable that makes one from the engine's optimizer) is stepped by engine.step(); `model_parameters` must be
    the model's trainable parameters (groups may repeat one set of hyperparameters). torch.distributed must be
    initialized (zeroedu.launch or torchrun) or this process becomes a world of one; `dist_init_required=False`
    refuses to start one (as in DeepSpeed, the caller has initialized torch.distributed).
    """
    if model is None:
        raise TypeError("zeroedu.initialize needs model=: the torch.nn.Module to train.")
    if mpu is not None:
        raise ValueError("initialize(mpu=...) describes model parallelism (Megatron's groups), which zeroedu does not "
                         "implement: every rank here is one data-parallel rank. Remove mpu=.")
    config = client.config_source(config, config_params, args)
    cfg = load_config(config)
    cfg, left_out = client.with_client_optimizer(cfg, model, optimizer, model_parameters)
    cfg.zeroedu.apply()   # the config's `zeroedu` knobs, set in this rank's modules before the engine reads them
    if not dist.is_initialized():
        if dist_init_required is False:   # as DeepSpeed: False means the caller has set torch.distributed up
            raise RuntimeError("initialize(dist_init_required=False) needs torch.distributed initialized already "
                               "(zeroedu.launch or torchrun do it): start the ranks that way, or leave the argument "
                               "out to let zeroedu start a world of one here.")
        init_distributed()
    say = lambda line: print(line) if dist.get_rank() == 0 else None  # noqa: E731
    client.freeze_left_out(model, left_out, say)
    for note in apply_leaf_module_config(model, cfg.zero_optimization.leaf_module or {})[1]:
        say(note)
    engine = engine_class(cfg)(model, cfg)
    if lr_scheduler is not None:
        engine.lr_scheduler = client.wrap_scheduler(lr_scheduler, optimizer, engine.optimizer)
    loader = client.data_loader(training_data, engine, collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler
