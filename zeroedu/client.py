"""What `initialize` does with DeepSpeed's client objects: an optimizer, an LR scheduler, model_parameters, data.

zeroedu always builds its own optimizer over the fp32 master pieces (the whole model at stage 0, this rank's shard
at stages 1-3). A client optimizer is therefore read, not used: its class and hyperparameters become the config's
`optimizer` section, and the state it would hold is sharded as that section's would be. A client torch scheduler
keeps stepping the client optimizer, and the engine copies the learning rate (and momentum) it sets into its own
optimizer after every step, so any torch scheduler computes exactly what it would have. Whatever cannot be
honoured is an error that says why and what to do instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroedu.config import Config, OptimizerConfig

# The hyperparameters zeroedu reads from each torch optimizer (the rest are implementation switches).
_READ = {
    torch.optim.Adam: ("Adam", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    torch.optim.AdamW: ("AdamW", ("lr", "betas", "eps", "weight_decay", "amsgrad")),
    torch.optim.SGD: ("SGD", ("lr", "momentum", "weight_decay", "nesterov", "dampening")),
}
_GROUP_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "nesterov", "dampening"}


def config_source(config, config_params, args):
    """The config from `config`, `config_params` (DeepSpeed's older name) or `args.deepspeed_config`."""
    given = [c for c in (config, config_params) if c is not None]
    if len(given) > 1:
        raise ValueError("initialize got both config= and config_params=: pass the config once.")
    if given:
        return given[0]
    path = getattr(args, "deepspeed_config", None) if args is not None else None
    if args is not None and path is None:
        raise ValueError("initialize(args=...) needs args.deepspeed_config (the config file's path), or pass config=.")
    return path


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, tuple | list):
        return tuple(_value(x) for x in v)
    return v


DECAY_ATTR = "zeroedu_weight_decay"  # its own weight decay, when groups differ (engine.facade reads it)


def _one_hyperparameter_set(groups: list[dict], where: str, default_decay: float = 0.0) -> dict[str, Any]:
    """The groups' shared hyperparameters; an error if they differ, except weight_decay: groups that differ in it
    only (the Hugging Face Trainer's "no decay on biases and norms") tag each parameter with its own, and the
    engine applies it per parameter (zeroedu.engine.facade); the shared set then has weight_decay 0."""
    sets = [{k: _value(v) for k, v in g.items() if k in _GROUP_KEYS} for g in groups]
    for key in sorted(set().union(*sets) - {"weight_decay"}):
        values = {repr(s.get(key)) for s in sets}
        if len(values) > 1:
            raise ValueError(
                f"{where} has parameter groups with different '{key}' ({', '.join(sorted(values))}). zeroedu steps one "
                f"flat shard with one set of hyperparameters: per-group weight_decay is supported, per-group "
                f"'{key}' is not. Use one value for it.")
    decays = [float(s.get("weight_decay", default_decay)) for s in sets]
    shared = dict(sets[0]) if sets else {}
    if len(set(decays)) > 1:
        for g, wd in zip(groups, decays, strict=True):
            for p in g["params"]:
                setattr(p, DECAY_ATTR, wd)
        shared["weight_decay"] = 0.0
    return shared


def _param_groups(params: Iterable) -> list[dict]:
    items = list(params)
    if items and all(isinstance(x, dict) for x in items):
        return [{**g, "params": list(g["params"])} for g in items]
    if any(isinstance(x, dict) for x in items):
        raise ValueError("model_parameters mixes parameter groups (dicts) and parameters: give one or the other.")
    return [{"params": items}]


def _check_coverage(model: torch.nn.Module, params: list[torch.Tensor], where: str) -> list[torch.nn.Parameter]:
    """The model's trainable parameters that `params` leaves out (DeepSpeed never steps those: its ZeRO optimizers
    flatten the optimizer's own trainable parameters only). Frozen parameters in `params` are skipped, as there."""
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for p in params):
        raise ValueError(f"{where} holds tensors that are not parameters of the model: pass the model's own.")
    given = {id(p) for p in params}
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) not in given]


def freeze_left_out(model: torch.nn.Module, left_out: list[torch.nn.Parameter], log) -> None:
    """Parameters the optimizer does not hold are not trained, as in DeepSpeed: zeroedu freezes them
    (requires_grad=False, so no gradient is computed or reduced for them) and says so."""
    if not left_out:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    for p in left_out:
        p.requires_grad_(False)
    listed = ", ".join(names[id(p)] for p in left_out[:5]) + (" ..." if len(left_out) > 5 else "")
    log(f"zeroedu note: {len(left_out)} trainable parameters are not in the optimizer ({listed}): they are not "
        f"trained, as in DeepSpeed, and zeroedu set requires_grad=False on them.")


def _check_finite(params: dict[str, Any], where: str) -> dict[str, Any]:
    """The hyperparameters, or an error naming the first that is inf or NaN (lr=inf trains into NaN silently)."""
    for key, value in params.items():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{where} has {key}={value!r}: hyperparameters must be finite numbers. Build it "
                                 f"with a finite {key}.")
    return params


def with_client_optimizer(cfg: Config, model: torch.nn.Module, optimizer,
                          model_parameters) -> tuple[Config, list[torch.nn.Parameter]]:
    """cfg with its optimizer section taken from a client optimizer (it wins over the config's, as in DeepSpeed),
    or from model_parameters' group hyperparameters; and the trainable parameters the optimizer leaves out."""
    for p in model.parameters():   # tags of an earlier initialize on this model
        if hasattr(p, DECAY_ATTR):
            delattr(p, DECAY_ATTR)
    if optimizer is None and model_parameters is None:
        return cfg, []
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        groups = _param_groups(model_parameters) if model_parameters is not None else \
            [{"params": [p for p in model.parameters() if p.requires_grad]}]
        optimizer = optimizer(groups if model_parameters is not None else groups[0]["params"])
    if optimizer is None:
        groups = _param_groups(model_parameters)
        left_out = _check_coverage(model, [p for g in groups for p in g["params"]], "model_parameters")
        shared = _one_hyperparameter_set(groups, "model_parameters",
                                         float(cfg.optimizer.params.get("weight_decay", 0.0)))
        if not shared:
            return cfg, left_out
        params = {**cfg.optimizer.params, **_check_finite(shared, "model_parameters")}
        return dataclasses.replace(cfg, optimizer=OptimizerConfig(type=cfg.optimizer.type, params=params)), left_out
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= must be a torch.optim.Optimizer (or a callable that makes one from parameters), "
                        f"got {type(optimizer).__name__}.")
    kind = _READ.get(type(optimizer))
    if kind is None:
        raise ValueError(f"optimizer= is a {type(optimizer).__name__}; zeroedu implements torch.optim.Adam, AdamW and "
                         f"SGD. Pass one of those, or the config's 'optimizer' section.")
    if optimizer.defaults.get("maximize"):
        raise ValueError("optimizer= has maximize=True, which zeroedu does not implement: minimize the negated loss.")
    groups = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    left_out = _check_coverage(model, [p for g in optimizer.param_groups for p in g["params"]], "optimizer=")
    shared = _one_hyperparameter_set(groups, f"optimizer= ({type(optimizer).__name__})")
    name, keys = kind
    params = {k: shared[k] for k in keys if k in shared}
    # The lr the optimizer was built with: a scheduler made before initialize may have changed the group's lr.
    params["lr"] = float(groups[0].get("initial_lr", params["lr"]))
    for key in ("amsgrad", "nesterov"):
        if not params.get(key):
            params.pop(key, None)
    if name in ("Adam", "AdamW"):
        # The client's kernel, as DeepSpeed steps the client optimizer itself: torch's default on CPU is not fused.
        params["fused"] = bool(optimizer.defaults.get("fused"))
    _check_finite(params, f"optimizer= ({type(optimizer).__name__})")
    return dataclasses.replace(cfg, optimizer=OptimizerConfig(type=name, params=params)), left_out


class ClientSchedule:
    """A client torch scheduler, stepped with the engine: it sets the client optimizer's lr (and momentum), and
    the engine's optimizer is given the same values."""

    def __init__(self, scheduler, client_optimizer: torch.optim.Optimizer, engine_optimizer: torch.optim.Optimizer):
        self.scheduler, self.client, self.engine = scheduler, client_optimizer, engine_optimizer
        self._copy()

    def _copy(self) -> None:
        src = self.client.param_groups[0]
        for group in self.engine.param_groups:
            for key in ("lr", "betas", "momentum"):
                if key in src and key in group:
                    group[key] = src[key]

    def step(self) -> None:
        self.scheduler.step()
        self._copy()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.engine.param_groups]

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        self._copy()


def wrap_scheduler(lr_scheduler, client_optimizer, engine_optimizer):
    """The engine's view of lr_scheduler: a callable is called with the engine's optimizer (DeepSpeed does the
    same); a torch scheduler over the client optimizer is mirrored (ClientSchedule)."""
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("lr_scheduler= is a ReduceLROnPlateau, which needs a metric at every step; engine.step() "
                         "has none. Step it yourself after evaluation, or use a schedule that depends on the step.")
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        if lr_scheduler.optimizer is not client_optimizer:
            raise ValueError("lr_scheduler= is a torch scheduler over an optimizer that was not passed as optimizer=: "
                             "pass that optimizer too, or pass a callable that makes the scheduler from the engine's "
                             "optimizer.")
        return ClientSchedule(lr_scheduler, client_optimizer, engine_optimizer)
    if isinstance(lr_scheduler, Callable):
        return lr_scheduler(engine_optimizer)
    raise TypeError(f"lr_scheduler= must be a torch LR scheduler or a callable, got {type(lr_scheduler).__name__}.")


def data_loader(training_data, engine, collate_fn=None) -> torch.utils.data.DataLoader:
    """DeepSpeed's training_data=: a loader of micro-batches, each rank its own part of every global batch."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=engine.world_size, rank=engine.rank, shuffle=False)
    return DataLoader(training_data, batch_size=engine.config.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn)
