"""The config: a documented subset of DeepSpeed's JSON, parsed into frozen dataclasses.

A key zeroedu knows is checked for type and range. A misspelt key is an error that names the closest valid
key. A real DeepSpeed key that zeroedu does not implement is an error that says so, so a graduate's config
never silently means something else here than it does in DeepSpeed.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config problem, with the key that caused it and what would fix it."""


# Real DeepSpeed keys that zeroedu deliberately does not implement, by section.
_DEEPSPEED_NOT_IMPLEMENTED = {
    "": {
        "train_batch_size", "steps_per_print", "wall_clock_breakdown", "dump_state", "scheduler",
        "amp", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
        "comms_logger", "autotuning", "elasticity", "pipeline", "sparse_attention", "data_efficiency",
        "compression_training", "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "checkpoint", "aio",
        "memory_breakdown", "sparse_gradients", "fp8", "torch_autocast", "seq_parallel_communication_data_type",
        "tensor_parallel", "curriculum_learning", "eigenvalue", "progressive_layer_drop",
    },
    "zero_optimization": {
        "reduce_scatter", "load_from_fp32_weights", "round_robin_gradients", "sub_group_size",
        "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "ignore_unused_parameters",
        "elastic_checkpoint", "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
        "stage3_module_granularity_threshold", "log_trace_cache_warnings",
        "zero_quantized_nontrainable_weights", "cpu_offload", "cpu_offload_params",
        "cpu_offload_use_pin_memory", "grad_hooks", "legacy_stage1", "use_multi_rank_bucket_allreduce",
        "allgather_partitions", "overlap_events",
    },
    "fp16": {"auto_cast", "loss_scale", "consecutive_hysteresis", "fp16_master_weights_and_grads"},
    "bf16": {"immediate_grad_update", "check_grad_overflow"},
    "zero_optimization.offload_optimizer": {"ratio", "fast_init", "pipeline_read", "pipeline_write"},
    "zero_optimization.offload_param": {"buffer_size", "max_in_cpu"},
}

_OPTIMIZERS = {
    "Adam": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "AdamW": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "SGD": {"lr", "momentum", "weight_decay", "nesterov", "dampening"},
}
_DEEPSPEED_OPTIMIZERS = {"OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lion", "MuAdam", "MuAdamW"}


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "Adam"
    params: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})

    @property
    def name(self) -> str:
        return self.type.lower()


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True)
class OffloadConfig:
    """`offload_optimizer` / `offload_param`: where a tier lives. Parsed here, used by zeroedu.offload.

    buffer_count: host buffers for NVMe, each the size of the largest sub-group piece: sub-groups of optimizer
    state in flight (offload_optimizer, DeepSpeed's default 4), parameter pieces on their way between NVMe and the
    device (offload_param, default 5). pin_memory: page-locked host buffers (used only when the device is a GPU).
    """

    device: str = "none"
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: int = 4


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    # None (the key left out): zeroedu sizes it to the model, where DeepSpeed uses fixed element counts (reduce
    # 5e8, prefetch 5e7, max live 1e9); see zeroedu.stages.sizing. A value given is used as given, as in DeepSpeed.
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int | None = None
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(buffer_count=5))
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1

    @property
    def bucket_numel(self) -> int:
        """One bucket layout serves both directions, so it is the smaller of the two sizes (None: automatic)."""
        return None if self.reduce_bucket_size is None else min(self.reduce_bucket_size, self.allgather_bucket_size)


@dataclass(frozen=True)
class Config:
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # zeroedu's own switch (not a DeepSpeed key): which collective implementation runs on gloo.
    comm_implementation: str = "auto"

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)


# ---- validation helpers -------------------------------------------------------------------------------

def _where(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _check_keys(section: str, given: dict[str, Any], known: set[str]) -> None:
    for key in given:
        if key in known:
            continue
        where = _where(section, key)
        if key in _DEEPSPEED_NOT_IMPLEMENTED.get(section, set()):
            raise ConfigError(
                f"'{where}' is a real DeepSpeed setting that zeroedu does not implement; remove it to run "
                f"here (zeroedu implements in this section: {', '.join(sorted(known))})."
            )
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
        hint = f" Did you mean '{_where(section, close[0])}'?" if close else ""
        raise ConfigError(f"unknown config key '{where}'.{hint} Valid keys here: {', '.join(sorted(known))}.")


def _bool(section: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"'{_where(section, key)}' must be true or false, got {value!r}.")
    return value


def _int(section: str, key: str, value: Any, lo: int, hi: int | None = None) -> int:
    # DeepSpeed configs often write sizes as 5e8: accept floats that are whole numbers.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"'{_where(section, key)}' must be an integer, got {value!r}.")
    if value < lo or (hi is not None and value > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"'{_where(section, key)}' must be {rng}, got {value}.")
    return value


def _size(section: str, raw: dict[str, Any], key: str, lo: int) -> int | None:
    """A buffer size in elements, or None where the config leaves it out (or writes null): automatic."""
    return None if raw.get(key) is None else _int(section, key, raw[key], lo)


def _float(section: str, key: str, value: Any, lo: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"'{_where(section, key)}' must be a number, got {value!r}.")
    if value < lo:
        raise ConfigError(f"'{_where(section, key)}' must be >= {lo}, got {value}.")
    return float(value)


def _section(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"'{key}' must be a JSON object (a dict), got {type(value).__name__}.")
    return value


def _parse_optimizer(raw: dict[str, Any]) -> OptimizerConfig:
    _check_keys("optimizer", raw, {"type", "params"})
    kind = raw.get("type", "Adam")
    if kind in _DEEPSPEED_OPTIMIZERS:
        raise ConfigError(
            f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zeroedu does not implement; "
            f"use one of {', '.join(_OPTIMIZERS)}."
        )
    if kind not in _OPTIMIZERS:
        close = difflib.get_close_matches(str(kind), list(_OPTIMIZERS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"'optimizer.type' must be one of {', '.join(_OPTIMIZERS)}, got {kind!r}.{hint}")
    params = raw.get("params", {"lr": 1e-3})
    if not isinstance(params, dict):
        raise ConfigError("'optimizer.params' must be a JSON object (a dict).")
    _check_keys("optimizer.params", params, _OPTIMIZERS[kind])
    for key, value in params.items():
        if key == "betas":
            ok = isinstance(value, list | tuple) and len(value) == 2
            if not ok or not all(isinstance(b, int | float) and 0 <= b < 1 for b in value):
                raise ConfigError(f"'optimizer.params.betas' must be two numbers in [0, 1), got {value!r}.")
        elif key in {"amsgrad", "nesterov"}:
            _bool("optimizer.params", key, value)
        else:
            _float("optimizer.params", key, value, 0.0)
    if "betas" in params:
        params = {**params, "betas": tuple(params["betas"])}
    return OptimizerConfig(type=kind, params=dict(params))


def _parse_offload(section: str, raw: Any, keys: set[str], buffer_count: int) -> OffloadConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"'{section}' must be a JSON object (a dict).")
    _check_keys(section, raw, keys)
    device = raw.get("device", "none")
    if device not in {"none", "cpu", "nvme"}:
        raise ConfigError(f"'{section}.device' must be 'none', 'cpu' or 'nvme', got {device!r}.")
    nvme_path = raw.get("nvme_path")
    if nvme_path is not None and not isinstance(nvme_path, str):
        raise ConfigError(f"'{section}.nvme_path' must be a path string, got {nvme_path!r}.")
    if device == "nvme" and not nvme_path:
        raise ConfigError(f"'{section}.device' is 'nvme' but '{section}.nvme_path' is not set: name a folder.")
    return OffloadConfig(
        device=device,
        pin_memory=_bool(section, "pin_memory", raw.get("pin_memory", False)),
        nvme_path=nvme_path,
        buffer_count=_int(section, "buffer_count", raw.get("buffer_count", buffer_count), 1),
    )


def _parse_zero(raw: dict[str, Any]) -> ZeroConfig:
    s = "zero_optimization"
    known = {
        "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "offload_optimizer", "offload_param", "zero_quantized_weights", "zero_quantized_gradients",
        "zero_hpz_partition_size",
    }
    _check_keys(s, raw, known)
    d = ZeroConfig()
    stage = _int(s, "stage", raw.get("stage", d.stage), 0, 3)
    off_opt = _parse_offload(f"{s}.offload_optimizer", raw.get("offload_optimizer", {}),
                             {"device", "pin_memory", "nvme_path", "buffer_count"}, d.offload_optimizer.buffer_count)
    off_par = _parse_offload(f"{s}.offload_param", raw.get("offload_param", {}),
                             {"device", "pin_memory", "nvme_path", "buffer_count"}, d.offload_param.buffer_count)
    if off_opt.device != "none" and stage == 0:
        raise ConfigError(
            f"'{s}.offload_optimizer' needs ZeRO stage 1, 2 or 3 (the optimizer state must be partitioned "
            f"to be offloaded); got stage 0. Set '{s}.stage' to 1 or more."
        )
    if off_par.device != "none" and stage != 3:
        raise ConfigError(
            f"'{s}.offload_param' works only at stage 3 (only stage 3 partitions parameters); got stage "
            f"{stage}. Set '{s}.stage' to 3 or remove offload_param."
        )
    qw = _bool(s, "zero_quantized_weights", raw.get("zero_quantized_weights", False))
    qg = _bool(s, "zero_quantized_gradients", raw.get("zero_quantized_gradients", False))
    hpz = _int(s, "zero_hpz_partition_size", raw.get("zero_hpz_partition_size", 1), 1)
    if (qw or qg or hpz > 1) and stage != 3:
        raise ConfigError(f"ZeRO++ ('zero_quantized_weights', 'zero_quantized_gradients', "
                          f"'zero_hpz_partition_size') works at stage 3 only; got stage {stage}.")
    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=_size(s, raw, "reduce_bucket_size", 1),
        allgather_bucket_size=_int(
            s, "allgather_bucket_size", raw.get("allgather_bucket_size", d.allgather_bucket_size), 1),
        overlap_comm=_bool(s, "overlap_comm", raw.get("overlap_comm", d.overlap_comm)),
        contiguous_gradients=_bool(s, "contiguous_gradients", raw.get("contiguous_gradients", True)),
        stage3_prefetch_bucket_size=_size(s, raw, "stage3_prefetch_bucket_size", 0),
        stage3_param_persistence_threshold=_int(
            s, "stage3_param_persistence_threshold",
            raw.get("stage3_param_persistence_threshold", d.stage3_param_persistence_threshold), 0),
        stage3_max_live_parameters=_size(s, raw, "stage3_max_live_parameters", 1),
        offload_optimizer=off_opt,
        offload_param=off_par,
        zero_quantized_weights=qw,
        zero_quantized_gradients=qg,
        zero_hpz_partition_size=hpz,
    )


def load_config(config: dict[str, Any] | str | os.PathLike | Config | None) -> Config:
    """Parse a DeepSpeed-style config (a dict, or a path to a JSON file) into a frozen `Config`."""
    if isinstance(config, Config):
        return config
    if config is None:
        config = {}
    if isinstance(config, str | os.PathLike):
        path = os.fspath(config)
        try:
            with open(path) as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist.") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path!r} is not valid JSON: {e}.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}.")
    top = {
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "optimizer",
        "fp16", "bf16", "zero_optimization", "comm_implementation",
    }
    _check_keys("", config, top)

    fp16_raw = _section(config, "fp16")
    _check_keys("fp16", fp16_raw, {"enabled", "initial_scale_power", "loss_scale_window", "hysteresis",
                                   "min_loss_scale"})
    fd = FP16Config()
    fp16 = FP16Config(
        enabled=_bool("fp16", "enabled", fp16_raw.get("enabled", False)),
        initial_scale_power=_int("fp16", "initial_scale_power", fp16_raw.get("initial_scale_power",
                                                                          fd.initial_scale_power), 0, 64),
        loss_scale_window=_int("fp16", "loss_scale_window", fp16_raw.get("loss_scale_window",
                                                                      fd.loss_scale_window), 1),
        hysteresis=_int("fp16", "hysteresis", fp16_raw.get("hysteresis", fd.hysteresis), 1),
        min_loss_scale=_float("fp16", "min_loss_scale", fp16_raw.get("min_loss_scale", fd.min_loss_scale), 0.0),
    )
    bf16_raw = _section(config, "bf16")
    _check_keys("bf16", bf16_raw, {"enabled"})
    bf16 = BF16Config(enabled=_bool("bf16", "enabled", bf16_raw.get("enabled", False)))
    if fp16.enabled and bf16.enabled:
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true: choose one precision.")

    impl = config.get("comm_implementation", "auto")
    if impl not in {"auto", "ring", "native"}:
        raise ConfigError(f"'comm_implementation' must be 'auto', 'ring' or 'native', got {impl!r}.")
    return Config(
        train_micro_batch_size_per_gpu=_int("", "train_micro_batch_size_per_gpu",
                                            config.get("train_micro_batch_size_per_gpu", 1), 1),
        gradient_accumulation_steps=_int("", "gradient_accumulation_steps",
                                         config.get("gradient_accumulation_steps", 1), 1),
        gradient_clipping=_float("", "gradient_clipping", config.get("gradient_clipping", 0.0), 0.0),
        optimizer=_parse_optimizer(_section(config, "optimizer")) if "optimizer" in config else OptimizerConfig(),
        fp16=fp16,
        bf16=bf16,
        zero_optimization=_parse_zero(_section(config, "zero_optimization")),
        comm_implementation=impl,
    )
