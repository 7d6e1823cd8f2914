"""The config: DeepSpeed's JSON, parsed into frozen dataclasses, so that real DeepSpeed configs run as written.

Every key falls in one of four groups. Implemented keys are checked for type and range (the batch keys, the
optimizer and `scheduler`, fp16/bf16, `zero_optimization`, the logging keys). Keys that change nothing here
are accepted with a note saying why: hardware keys (`aio`, `pin_memory`, `fast_init`) say what they would do
on a GPU machine. Some keys are accepted at DeepSpeed's default value only. Keys outside what zeroedu teaches
(pipeline, MoE, compression, 1-bit optimizers, ...) are refused with the reason. A misspelt key names the
closest valid one, and "auto" (the Hugging Face Trainer's placeholder) says which value to write. Every
problem of a config is reported in one ConfigError, so a learner fixes them all at once.

Where a default differs from DeepSpeed's (docs/benchmarks.md, "At the defaults", has the table): a bucket or
prefetch size left out is sized to the model (zeroedu.stages.sizing; DeepSpeed: reduce_bucket_size 5e8,
stage3_prefetch_bucket_size 5e7, stage3_max_live_parameters 1e9; zeroedu's live limit is twice its prefetch size,
Psi/8 at least the largest unit); overlap_comm is true at every stage (DeepSpeed: at stage 3 only);
allgather_bucket_size left out gathers every bucket in one collective where that packs nothing (gloo's direct
all-gather), one bucket at a time otherwise (DeepSpeed: parts of 5e8); stage3_max_reuse_distance left out is 0:
every unit is released after its last forward use and gathered again for backward, the 3 Psi of the ZeRO paper
(DeepSpeed: 1e9, which keeps every parameter of a model below about 5e8 elements gathered from forward to
backward); a config without an
optimizer section gets Adam at lr 1e-3, and one without batch keys a micro-batch of 1 (DeepSpeed: no optimizer,
and an error for the batch).

To add a key: put it in its section's parser (and dataclass), or in zeroedu.ds_keys (NOTED, DEFAULT_ONLY
or REFUSED).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from zeroedu.ds_keys import DEEPSPEED_OPTIMIZERS, DEPRECATED_OFFLOAD, NOTED, PIN_NOTE, auto_problem, classify


class ConfigError(ValueError):
    """A config problem, with the key that caused it and what would fix it."""


class _Problems:
    """Everything wrong with a config, collected so that one error reports all of it; and the notes."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.notes: list[str] = []

    def get(self, section: str, raw: dict[str, Any], key: str, default: Any, check=None, *args) -> Any:
        """raw[key] checked by `check(section, key, value, *args)`, or the default (and a problem recorded)."""
        if key not in raw:
            return default
        value = raw[key]
        if isinstance(value, str) and value == "auto":
            self.errors.append(auto_problem(_where(section, key)))
            return default
        if check is None:
            return value
        try:
            return check(section, key, value, *args)
        except ConfigError as e:
            self.errors.append(str(e))
            return default

    def keys(self, section: str, given: dict[str, Any], known: set[str]) -> None:
        """Every key of `given` is implemented, noted, at a default, or a problem (refused or a typo)."""
        for key, value in given.items():
            if key in known:
                continue
            where = _where(section, key)
            said = classify(section, key, value, where)   # zeroedu.ds_keys: a DeepSpeed key not implemented here
            if said is None:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
                hint = f" Did you mean '{_where(section, close[0])}'?" if close else ""
                self.errors.append(f"unknown config key '{where}'.{hint} Valid keys here: "
                                   f"{', '.join(sorted(known))}.")
            elif said[0] == "error":
                self.errors.append(said[1])
            elif said[0] == "note":
                self.notes.append(said[1])

    def section(self, raw: dict[str, Any], key: str, parent: str = "") -> dict[str, Any]:
        value = raw.get(key, {})
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.errors.append(f"'{_where(parent, key)}' must be a JSON object (a dict), got {type(value).__name__}.")
            return {}
        return value

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise ConfigError(self.errors[0])
        if self.errors:
            listed = "\n".join(f"  {i}. {e}" for i, e in enumerate(self.errors, 1))
            raise ConfigError(f"{len(self.errors)} problems in this config, each with its fix:\n{listed}")


_OPTIMIZERS = {
    "Adam": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "AdamW": {"lr", "betas", "eps", "weight_decay", "amsgrad"},
    "SGD": {"lr", "momentum", "weight_decay", "nesterov", "dampening"},
}
# DeepSpeed's own spellings in an Adam section: adam_w_mode (Adam's weight decay is decoupled unless it is false),
# torch_adam (use torch's kernel: zeroedu always does), bias_correction (always on in torch).
_ADAM_EXTRAS = {"adam_w_mode", "torch_adam", "bias_correction"}


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "Adam"
    params: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})

    @property
    def name(self) -> str:
        return self.type.lower()


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: one of DeepSpeed's schedules (zeroedu.schedulers), stepped by engine.step()."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FP16Config:
    """fp16 loss scaling as DeepSpeed spells it: loss_scale 0 is dynamic, any other value a fixed scale."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True)
class CommsLoggerConfig:
    """`comms_logger`: verbose prints each collective of a step after it; log_summary() prints the totals."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    debug: bool = False
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
    # None (zeroedu's default): after the step, one all-gather for every reduce bucket where it packs nothing
    # (Comm.packs_nothing: each piece lands in place), else one per bucket; a number: all-gathers of at most this
    # many elements, whatever the reduce buckets are, as DeepSpeed's stages 1-2 cut them.
    allgather_bucket_size: int | None = None
    # True at every stage here; DeepSpeed's default is None, made True at stage 3 only (`overlap_comm_valid` in
    # deepspeed/runtime/zero/config.py), so its stages 1-2 reduce one bucket after the other unless the config says.
    overlap_comm: bool = True
    # Accepted and changes nothing: stages 0-1 reduce views of one flat gradient buffer, and stages 2-3 copy each
    # bucket into a buffer of its own (made when the bucket is full, freed once reduced) with the switch on or off.
    # In DeepSpeed it chooses between copying gradients into one preallocated reduce buffer (true) and reducing them
    # where they are (false).
    contiguous_gradients: bool = True
    # Stages 1-3: reduce-scatter each gradient bucket (True), or all-reduce it and keep this rank's piece (False).
    reduce_scatter: bool = True
    # Stages 1-2 only (h-facts, issue 29): True all-reduces each gradient bucket and keeps this rank's piece, as
    # DeepSpeed's `average_tensor` (stage_1_and_2.py) does at its default (true since 0.12.4): 3 Psi elements a step
    # with the parameter all-gather. zeroedu's default is False, the ZeRO paper's reduce-scatter (2 Psi elements a
    # step, what DDP's all-reduce moves), because the course teaches the paper's volumes; set true to match
    # DeepSpeed's bytes. DeepSpeed's stage 3 has no such key: there it changes nothing.
    use_multi_rank_bucket_allreduce: bool = False
    # Without offload_optimizer the optimizer step runs over sub-groups of master pieces of at most this many
    # elements, one at a time. With offload_optimizer it is not applied (the host step runs over the whole shard at
    # once; the NVMe tier moves one bucket's piece at a time): a note says so. DeepSpeed reads it in its stage-3
    # optimizer ("Tile size for parameter processing ... Used by ZeRO3-Offload and ZeRO-Infinity",
    # deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training and sub_group_size in
    # deepspeed/runtime/zero/config.py); its stages 1-2 ignore it.
    sub_group_size: int = 1_000_000_000
    round_robin_gradients: bool = False
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int | None = None
    # A unit whose next use (its own backward) comes before this many elements of other modules' parameters are
    # used stays gathered from its last forward use to its backward (stage3.py). 0: none does.
    stage3_max_reuse_distance: int = 0
    stage3_gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(buffer_count=5))
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """`activation_checkpointing`: how zeroedu.checkpointing.checkpoint keeps a checkpoint (ZeRO-R's P_a).

    As in DeepSpeed, cpu_checkpointing and contiguous_memory_optimization act on the partitioned checkpoint, so
    they need partition_activations; contiguous_memory_optimization needs number_checkpoints (the buffer's slots).
    """

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class DataTypesConfig:
    """`data_types`: grad_accum_dtype is the dtype gradients accumulate in across micro-steps ("fp32", "bf16",
    "fp16"); None means the compute dtype, as without the section."""

    grad_accum_dtype: str | None = None


def _parse_activation_checkpointing(p: _Problems, raw: dict[str, Any]) -> ActivationCheckpointingConfig:
    s = "activation_checkpointing"
    flags = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
             "synchronize_checkpoint_boundary", "profile")
    p.keys(s, raw, {*flags, "number_checkpoints"})
    kw: dict[str, Any] = {k: p.get(s, raw, k, False, _bool) for k in flags if k in raw}
    if raw.get("number_checkpoints") is not None:
        kw["number_checkpoints"] = p.get(s, raw, "number_checkpoints", None, _int, 1)
    out = ActivationCheckpointingConfig(**kw)
    for needs in ("cpu_checkpointing", "contiguous_memory_optimization"):
        if getattr(out, needs) and not out.partition_activations:
            p.errors.append(f"'{s}.{needs}' acts on partitioned checkpoints (as in DeepSpeed): set "
                            f"'{s}.partition_activations' to true too (without tensor parallelism a partition "
                            f"is the whole checkpoint).")
    auto = raw.get("number_checkpoints") == "auto"   # already reported as "auto"
    if out.contiguous_memory_optimization and out.number_checkpoints is None and not auto:
        p.errors.append(f"'{s}.contiguous_memory_optimization' needs '{s}.number_checkpoints': how many "
                        f"checkpoints one forward makes (the contiguous buffer has that many slots).")
    return out


def _parse_data_types(p: _Problems, raw: dict[str, Any]) -> DataTypesConfig:
    p.keys("data_types", raw, {"grad_accum_dtype"})
    dtype = raw.get("grad_accum_dtype")
    if dtype is not None:
        dtype = p.get("data_types", raw, "grad_accum_dtype", None, _choice, ("fp32", "bf16", "fp16"))
    return DataTypesConfig(grad_accum_dtype=dtype)


@dataclass(frozen=True)
class Config:
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    # train_batch_size = micro x accumulation x world size: known once the world size is (Config.for_world).
    train_batch_size: int | None = None
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # Logging, as DeepSpeed's keys: every `steps_per_print` optimizer steps rank 0 prints step, loss, lr and loss
    # scale; wall_clock_breakdown and memory_breakdown print every step; comms_logger (see CommsLoggerConfig).
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    dump_state: bool = False
    # zeroedu's own switch (not a DeepSpeed key): which collective implementation runs on gloo.
    comm_implementation: str = "auto"
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    # Which of the three batch keys the config wrote (the others are derived by for_world).
    batch_keys_given: tuple[str, ...] = ()
    # What the config asked for that changes nothing here, and why (rank 0 prints them at initialize).
    notes: tuple[str, ...] = ()

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)

    def for_world(self, world_size: int) -> Config:
        """The three batch sizes for `world_size` ranks, as DeepSpeed derives them: any two give the third (one
        alone: no accumulation). An inconsistent set is an error that shows the arithmetic."""
        import dataclasses

        given = {k: getattr(self, k) for k in self.batch_keys_given}
        if "train_batch_size" not in given:
            micro, accum = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
            return dataclasses.replace(self, train_batch_size=micro * accum * world_size)
        tbs = given["train_batch_size"]
        micro, accum = given.get("train_micro_batch_size_per_gpu"), given.get("gradient_accumulation_steps")
        if micro is not None and accum is None:
            accum = tbs // micro // world_size
        elif micro is None:
            accum = accum or 1
            micro = tbs // world_size // accum
        if micro * accum * world_size != tbs or micro < 1 or accum < 1:
            raise ConfigError(_batch_problem(tbs, given, micro, accum, world_size))
        return dataclasses.replace(self, train_batch_size=tbs, train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=accum)


def _batch_problem(tbs: int, given: dict[str, int], micro: int, accum: int, world: int) -> str:
    """Why train_batch_size does not split, with the arithmetic and the nearest sizes that do."""
    if len(given) == 3:
        got = micro * accum * world
        return (f"train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
                f"size: {micro} x {accum} x {world} = {got}, but train_batch_size is {tbs}. Write "
                f"train_batch_size {got}, or leave one of the three out and it is derived.")
    if "train_micro_batch_size_per_gpu" in given:
        unit, what = micro * world, "train_micro_batch_size_per_gpu x world size"
        factors = f"{micro} x {world}"
    else:
        unit, what = accum * world, "gradient_accumulation_steps x world size"
        factors = f"{accum} x {world}"
    lower, upper = max(unit, tbs // unit * unit), (tbs // unit + 1) * unit
    return (f"train_batch_size {tbs} does not split over {what} = {factors} = {unit}: {tbs} / {unit} = "
            f"{tbs / unit:g} is not a whole number >= 1. Write train_batch_size {lower} or {upper}, or change the "
            f"others so that train_batch_size = micro batch x accumulation steps x world size.")


# ---- validation helpers -------------------------------------------------------------------------------

def _where(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


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


def _size(section: str, key: str, value: Any, lo: int) -> int | None:
    """A buffer size in elements; null means automatic, as leaving the key out does (zeroedu.stages.sizing)."""
    return None if value is None else _int(section, key, value, lo)


def _float(section: str, key: str, value: Any, lo: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"'{_where(section, key)}' must be a number, got {value!r}.")
    if value < lo:
        raise ConfigError(f"'{_where(section, key)}' must be >= {lo}, got {value}.")
    return float(value)


def _refuse_non_finite(value: Any, where: str = "") -> None:
    """Every number in the config must be finite: JSON files may spell NaN and Infinity, and Python's json reads
    them. lr=inf trains into NaN losses and gradient_clipping=NaN silently turns clipping off (NaN > 0 is false),
    so refuse them wherever they appear, before any key is read."""
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_non_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _refuse_non_finite(v, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"'{where}' must be a finite number, got {value!r}. Write the number itself (a limit "
                          "that is off is 0 or the key left out, as DeepSpeed's defaults do).")


def _choice(section: str, key: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        listed = ', '.join(map(repr, choices[:-1])) + f' or {choices[-1]!r}'
        raise ConfigError(f"'{_where(section, key)}' must be {listed}, got {value!r}.")
    return value


# ---- sections -----------------------------------------------------------------------------------------

def _parse_optimizer(p: _Problems, raw: dict[str, Any]) -> OptimizerConfig:
    s = "optimizer"
    p.keys(s, raw, {"type", "params"})
    kind = raw.get("type", "Adam")
    if kind == "auto":
        p.errors.append(auto_problem("optimizer.type", "\"AdamW\", its default optimizer"))
        return OptimizerConfig()
    if kind in DEEPSPEED_OPTIMIZERS:
        reason = ("communication-compressed (1-bit) optimizers are not part of ZeRO" if "One" in str(kind)
                  else "zeroedu implements torch's Adam, AdamW and SGD")
        p.errors.append(f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zeroedu does not implement: "
                        f"{reason}; use one of {', '.join(_OPTIMIZERS)}.")
        return OptimizerConfig()
    if kind not in _OPTIMIZERS:
        close = difflib.get_close_matches(str(kind), list(_OPTIMIZERS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        p.errors.append(f"'optimizer.type' must be one of {', '.join(_OPTIMIZERS)}, got {kind!r}.{hint}")
        return OptimizerConfig()
    params = p.section(raw, "params", s)
    ps = "optimizer.params"
    extras = _ADAM_EXTRAS if kind in ("Adam", "AdamW") else set()
    p.keys(ps, params, _OPTIMIZERS[kind] | extras)
    out: dict[str, Any] = {}
    for key in params:
        if key not in _OPTIMIZERS[kind]:
            continue
        if key == "betas":
            out[key] = p.get(ps, params, key, None, _betas)
        elif key in {"amsgrad", "nesterov"}:
            out[key] = p.get(ps, params, key, False, _bool)
        else:
            out[key] = p.get(ps, params, key, 0.0, _float, 0.0)
    out = {k: v for k, v in out.items() if v is not None}
    if "lr" not in params:
        out["lr"] = 1e-3
    if p.get(ps, params, "torch_adam", False, _bool):
        p.notes.append("'optimizer.params.torch_adam': zeroedu always runs torch's Adam kernel.")
    if not p.get(ps, params, "bias_correction", True, _bool):
        p.errors.append("'optimizer.params.bias_correction' false is not implemented (torch's Adam always corrects "
                        "the bias). Remove it.")
    adam_w_mode = p.get(ps, params, "adam_w_mode", True, _bool)
    if kind == "AdamW" and not adam_w_mode:
        p.errors.append("'optimizer.params.adam_w_mode' is false for AdamW: write type \"Adam\" for L2 weight decay.")
    if kind == "Adam" and out.get("weight_decay", 0.0) > 0 and adam_w_mode:
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false: that is torch's AdamW.
        kind = "AdamW"
        p.notes.append("'optimizer.type' Adam with weight_decay: DeepSpeed's Adam decouples weight decay "
                       "(adam_w_mode defaults to true), so it runs as torch's AdamW here too.")
    return OptimizerConfig(type=kind, params=out)


def _betas(section: str, key: str, value: Any) -> tuple[float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
        raise ConfigError(f"'{_where(section, key)}' must be two numbers in [0, 1), got {value!r}.")
    return (float(value[0]), float(value[1]))


def _parse_scheduler(p: _Problems, raw: dict[str, Any]) -> SchedulerConfig | None:
    from zeroedu import schedulers

    s = "scheduler"
    p.keys(s, raw, {"type", "params"})
    kind = raw.get("type")
    if kind == "auto":
        p.errors.append(auto_problem("scheduler.type", "\"WarmupDecayLR\" for its linear warmup and decay; the "
                                                        "others are " + ", ".join(schedulers.PARAMS)))
        return None
    if kind not in schedulers.PARAMS:
        close = difflib.get_close_matches(str(kind), list(schedulers.PARAMS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        p.errors.append(f"'scheduler.type' must be one of {', '.join(schedulers.PARAMS)}, got {kind!r}.{hint}")
        return None
    params = p.section(raw, "params", s)
    ps = "scheduler.params"
    allowed = schedulers.PARAMS[kind]
    p.keys(ps, params, set(allowed))
    out: dict[str, Any] = {}
    for key in allowed:
        if key not in params:
            if allowed[key] is None and key != "cycle_second_step_size" and key != "cycle_second_stair_count":
                p.errors.append(f"'{ps}.{key}' is required by {kind}: add it.")
            continue
        if isinstance(params[key], list | tuple):
            p.errors.append(f"'{ps}.{key}' must be one number: zeroedu's engine has one parameter group.")
        elif key == "warmup_type":
            out[key] = p.get(ps, params, key, "log", _choice, ("log", "linear"))
        elif key in schedulers.SWITCHES:
            out[key] = p.get(ps, params, key, allowed[key], _bool)
        elif key in schedulers.COUNTS:
            lo = -1 if key == "last_batch_iteration" else 0 if "stair" in key or key == "decay_step_size" else 1
            out[key] = p.get(ps, params, key, 1, _int, lo)
        else:
            out[key] = p.get(ps, params, key, 0.0, _float, 0.0)
    return SchedulerConfig(type=kind, params=out)


def _parse_fp16(p: _Problems, raw: dict[str, Any]) -> FP16Config:
    s, d = "fp16", FP16Config()
    p.keys(s, raw, {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                    "consecutive_hysteresis", "min_loss_scale"})
    return FP16Config(
        enabled=p.get(s, raw, "enabled", False, _bool),
        loss_scale=p.get(s, raw, "loss_scale", d.loss_scale, _float, 0.0),
        initial_scale_power=p.get(s, raw, "initial_scale_power", d.initial_scale_power, _int, 0, 64),
        loss_scale_window=p.get(s, raw, "loss_scale_window", d.loss_scale_window, _int, 1),
        hysteresis=p.get(s, raw, "hysteresis", d.hysteresis, _int, 1),
        consecutive_hysteresis=p.get(s, raw, "consecutive_hysteresis", False, _bool),
        min_loss_scale=p.get(s, raw, "min_loss_scale", d.min_loss_scale, _float, 0.0),
    )


def _parse_bf16(p: _Problems, config: dict[str, Any]) -> BF16Config:
    # "bfloat16" is DeepSpeed's older name for the section; DeepSpeed reads it only when "bf16" is absent
    # (get_bfloat16_config in deepspeed/runtime/precision_config.py), and so does zeroedu.
    bf16_key = "bfloat16" if "bfloat16" in config and "bf16" not in config else "bf16"
    if "bfloat16" in config:
        p.notes.append("'bfloat16' is DeepSpeed's older name for 'bf16': " + (
            "read as 'bf16'." if bf16_key == "bfloat16" else "ignored, since 'bf16' is given (as DeepSpeed does)."))
    bf16_raw = p.section(config, bf16_key)
    p.keys(bf16_key, bf16_raw, {"enabled"})
    return BF16Config(enabled=p.get(bf16_key, bf16_raw, "enabled", False, _bool))


def _parse_comms_logger(p: _Problems, raw: dict[str, Any]) -> CommsLoggerConfig:
    s = "comms_logger"
    p.keys(s, raw, {"enabled", "verbose", "prof_all", "prof_ops", "debug"})
    ops = p.get(s, raw, "prof_ops", [])
    if not isinstance(ops, list | tuple) or not all(isinstance(o, str) for o in ops):
        p.errors.append(f"'comms_logger.prof_ops' must be a list of collective names, got {ops!r}.")
        ops = []
    return CommsLoggerConfig(enabled=p.get(s, raw, "enabled", False, _bool),
                             verbose=p.get(s, raw, "verbose", False, _bool),
                             prof_all=p.get(s, raw, "prof_all", True, _bool), prof_ops=tuple(ops),
                             debug=p.get(s, raw, "debug", False, _bool))


def _parse_offload(p: _Problems, section: str, raw: dict[str, Any], buffer_count: int) -> OffloadConfig:
    p.keys(section, raw, {"device", "pin_memory", "nvme_path", "buffer_count"})
    device = p.get(section, raw, "device", "none", _choice, ("none", "cpu", "nvme"))
    nvme_path = raw.get("nvme_path")
    if nvme_path is not None and not isinstance(nvme_path, str):
        p.errors.append(f"'{section}.nvme_path' must be a path string, got {nvme_path!r}.")
        nvme_path = None
    if device == "nvme" and not nvme_path:
        p.errors.append(f"'{section}.device' is 'nvme' but '{section}.nvme_path' is not set: name a folder.")
    pin = p.get(section, raw, "pin_memory", False, _bool)
    if pin:
        p.notes.append(PIN_NOTE.format(where=section))
    return OffloadConfig(device=device, pin_memory=pin, nvme_path=nvme_path,
                         buffer_count=p.get(section, raw, "buffer_count", buffer_count, _int, 1))


def _parse_zero(p: _Problems, raw: dict[str, Any]) -> ZeroConfig:
    s, d = "zero_optimization", ZeroConfig()
    known = {
        "stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
        "reduce_scatter", "use_multi_rank_bucket_allreduce",
        "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save", "offload_optimizer", "offload_param", "zero_quantized_weights",
        "zero_quantized_gradients", "zero_hpz_partition_size", *DEPRECATED_OFFLOAD,
    }
    p.keys(s, raw, known)
    stage = p.get(s, raw, "stage", d.stage, _int, 0, 3)
    raw = _map_deprecated_offload(p, raw)
    off_opt = _parse_offload(p, f"{s}.offload_optimizer", p.section(raw, "offload_optimizer", s),
                             d.offload_optimizer.buffer_count)
    off_par = _parse_offload(p, f"{s}.offload_param", p.section(raw, "offload_param", s), d.offload_param.buffer_count)
    if off_opt.device != "none" and stage == 0:
        p.errors.append(f"'{s}.offload_optimizer' needs ZeRO stage 1, 2 or 3 (the optimizer state must be "
                        f"partitioned to be offloaded); got stage 0. Set '{s}.stage' to 1 or more.")
    if off_par.device != "none" and stage != 3:
        p.errors.append(f"'{s}.offload_param' works only at stage 3 (only stage 3 partitions parameters); got "
                        f"stage {stage}. Set '{s}.stage' to 3 or remove offload_param.")
    qw = p.get(s, raw, "zero_quantized_weights", False, _bool)
    qg = p.get(s, raw, "zero_quantized_gradients", False, _bool)
    hpz = p.get(s, raw, "zero_hpz_partition_size", 1, _int, 1)
    if (qw or qg or hpz > 1) and stage != 3:
        p.errors.append(f"ZeRO++ ('zero_quantized_weights', 'zero_quantized_gradients', "
                        f"'zero_hpz_partition_size') works at stage 3 only; got stage {stage}.")
    gather16 = p.get(s, raw, "stage3_gather_16bit_weights_on_model_save", False, _bool)
    gather16 = p.get(s, raw, "stage3_gather_fp16_weights_on_model_save", gather16, _bool)   # the older spelling
    round_robin = p.get(s, raw, "round_robin_gradients", False, _bool)
    if round_robin:
        p.notes.append(NOTED[s]["round_robin_gradients"])
    _zero_notes(p, raw, stage, off_opt)
    return ZeroConfig(
        stage=stage,
        reduce_bucket_size=p.get(s, raw, "reduce_bucket_size", None, _size, 1),
        allgather_bucket_size=p.get(s, raw, "allgather_bucket_size", None, _int, 1),
        overlap_comm=p.get(s, raw, "overlap_comm", d.overlap_comm, _bool),
        contiguous_gradients=p.get(s, raw, "contiguous_gradients", True, _bool),
        reduce_scatter=p.get(s, raw, "reduce_scatter", True, _bool),
        use_multi_rank_bucket_allreduce=p.get(s, raw, "use_multi_rank_bucket_allreduce", False, _bool),
        sub_group_size=p.get(s, raw, "sub_group_size", d.sub_group_size, _int, 1),
        round_robin_gradients=round_robin,
        stage3_prefetch_bucket_size=p.get(s, raw, "stage3_prefetch_bucket_size", None, _size, 0),
        stage3_param_persistence_threshold=p.get(s, raw, "stage3_param_persistence_threshold",
                                                 d.stage3_param_persistence_threshold, _int, 0),
        stage3_max_live_parameters=p.get(s, raw, "stage3_max_live_parameters", None, _size, 1),
        stage3_max_reuse_distance=p.get(s, raw, "stage3_max_reuse_distance", 0, _size, 0) or 0,   # null: 0
        stage3_gather_16bit_weights_on_model_save=gather16,
        offload_optimizer=off_opt,
        offload_param=off_par,
        zero_quantized_weights=qw,
        zero_quantized_gradients=qg,
        zero_hpz_partition_size=hpz,
    )


def _zero_notes(p: _Problems, raw: dict[str, Any], stage: int, off_opt: OffloadConfig) -> None:
    """The zero_optimization keys that are valid but change nothing at this stage or with this offload: a note each."""
    s = "zero_optimization"
    if stage == 3 and "allgather_bucket_size" in raw:
        p.notes.append(f"'{s}.allgather_bucket_size' is for stages 1-2; stage 3 gathers parameters unit by unit, "
                       "sized by stage3_prefetch_bucket_size.")
    if stage == 0 and raw.get("reduce_scatter") is False:
        p.notes.append(f"'{s}.reduce_scatter' false changes nothing at stage 0, which all-reduces anyway.")
    if stage < 2 and p.get(s, raw, "contiguous_gradients", True, _bool) is False:
        p.notes.append(f"'{s}.contiguous_gradients' false changes nothing at stage {stage}: stages 0-1 keep the "
                       "gradients in one flat buffer, which is contiguous by construction.")
    elif raw.get("contiguous_gradients") is False:
        p.notes.append(f"'{s}.contiguous_gradients' false changes nothing at stage {stage}: zeroedu copies each "
                       "bucket's gradients into a buffer made for that bucket and freed once it is reduced, with the "
                       "switch on or off (DeepSpeed, with it false, reduces the gradients where they lie instead of "
                       "copying them into one preallocated buffer).")
    if "sub_group_size" in raw and off_opt.device != "none":
        p.notes.append(f"'{s}.sub_group_size' is not applied with offload_optimizer: the host step runs over the "
                       "whole shard at once (the NVMe tier moves one bucket's piece at a time, whatever this says). "
                       "DeepSpeed reads it at stage 3 (ZeRO-3 Offload and ZeRO-Infinity) only.")


def _map_deprecated_offload(p: _Problems, raw: dict[str, Any]) -> dict[str, Any]:
    s = "zero_optimization"
    out = dict(raw)
    for old, new in DEPRECATED_OFFLOAD.items():
        if old not in out:
            continue
        value = p.get(s, out, old, None, _bool)
        del out[old]
        if new in raw:
            p.errors.append(f"'{s}.{old}' and '{s}.{new}' are both given: '{old}' is the deprecated spelling of "
                            f"'{new}' (DeepSpeed refuses the two together too). Keep '{new}'.")
            continue
        p.notes.append(f"'{s}.{old}' is deprecated in DeepSpeed: write \"{new}\": {{\"device\": \"cpu\"}}"
                       + (" (read as that here)." if value else " (false: no offload)."))
        if value:
            out[new] = {"device": "cpu"}
    return out


_TOP = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "comms_logger", "dump_state", "comm_implementation", "activation_checkpointing", "data_types",
    "bfloat16",
}


def load_config(config: dict[str, Any] | str | os.PathLike | Config | None) -> Config:
    """Parse a DeepSpeed config (a dict, or a path to a JSON file) into a frozen `Config`.

    Every problem is collected and reported in one ConfigError, each with its fix.
    """
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
    _refuse_non_finite(config)
    p = _Problems()
    p.keys("", config, _TOP)

    fp16 = _parse_fp16(p, p.section(config, "fp16"))
    bf16 = _parse_bf16(p, config)
    if fp16.enabled and bf16.enabled:
        p.errors.append("'fp16.enabled' and 'bf16.enabled' are both true: choose one precision.")

    batch = {k: p.get("", config, k, None, _int, 1) for k in _BATCH_KEYS if k in config}
    impl = p.get("", config, "comm_implementation", "auto", _choice, ("auto", "ring", "native"))
    spp = config.get("steps_per_print")
    cfg = Config(
        train_micro_batch_size_per_gpu=batch.get("train_micro_batch_size_per_gpu") or 1,
        gradient_accumulation_steps=batch.get("gradient_accumulation_steps") or 1,
        train_batch_size=batch.get("train_batch_size"),
        gradient_clipping=p.get("", config, "gradient_clipping", 0.0, _float, 0.0),
        optimizer=_parse_optimizer(p, p.section(config, "optimizer")) if "optimizer" in config else OptimizerConfig(),
        scheduler=_parse_scheduler(p, p.section(config, "scheduler")) if config.get("scheduler") else None,
        fp16=fp16,
        bf16=bf16,
        zero_optimization=_parse_zero(p, p.section(config, "zero_optimization")),
        steps_per_print=None if spp is None else p.get("", config, "steps_per_print", None, _int, 1),
        wall_clock_breakdown=p.get("", config, "wall_clock_breakdown", False, _bool),
        memory_breakdown=p.get("", config, "memory_breakdown", False, _bool),
        comms_logger=_parse_comms_logger(p, p.section(config, "comms_logger")),
        dump_state=p.get("", config, "dump_state", False, _bool),
        comm_implementation=impl,
        activation_checkpointing=_parse_activation_checkpointing(p, p.section(config, "activation_checkpointing")),
        data_types=_parse_data_types(p, p.section(config, "data_types")),
        batch_keys_given=tuple(k for k in _BATCH_KEYS if batch.get(k) is not None),
        notes=tuple(dict.fromkeys(p.notes)),
    )
    p.raise_if_any()
    return cfg
