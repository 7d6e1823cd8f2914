"""The top level of the config: the `Config` dataclass (one field per top-level key) and `load_config`."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any

from zeroedu.config.declare import (
    ConfigError,
    Problems,
    anything,
    auto_problem,
    boolean,
    choice,
    integer,
    key,
    keys_of,
    number,
    parse,
    refuse_non_finite,
)
from zeroedu.config.sections import (
    ADAM,
    DEEPSPEED_OPTIMIZERS,
    OPTIMIZERS,
    ActivationCheckpointingConfig,
    BF16Config,
    CommsLoggerConfig,
    DataTypesConfig,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    OptimizerParams,
    SchedulerConfig,
    ZeroConfig,
    ZeroeduConfig,
)

_PARALLEL = "model parallelism, outside ZeRO's data parallelism (the only parallelism zeroedu teaches)"
_NO_MONITOR = ("zeroedu has no monitor backends; engine.ledger, engine.memory() and engine.log_lines hold what "
               "they would record")
_RECIPE = "a training-recipe feature outside ZeRO"
_GPU = "on a GPU machine"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _off(*on_keys: str, at: dict[str, Any] | None = None):
    """A section switched off: none of `on_keys` true and each `at` key at its off value (or absent)."""
    at = at or {}
    return lambda v: isinstance(v, dict) and not any(v.get(k) for k in on_keys) and all(
        v.get(k, off) in (off, None) for k, off in at.items())


def _parse_optimizer(p: Problems, raw: Any, name: str) -> OptimizerConfig:
    if not isinstance(raw, dict):
        p.errors.append(f"'{name}' must be a JSON object (a dict), got {type(raw).__name__} {raw!r}.")
        return OptimizerConfig()
    for k in raw:
        if k not in ("type", "params", "legacy_fusion"):
            _unknown(p, name, str(k), ["legacy_fusion", "params", "type"])
    if raw.get("legacy_fusion"):
        p.notes.append("'optimizer.legacy_fusion' chooses DeepSpeed's older fused fp16 optimizer wrapper; zeroedu's "
                       "step is the same with or without it.")
    kind = raw.get("type", "Adam")
    if kind == "auto":
        p.errors.append(auto_problem("optimizer.type", "\"AdamW\", its default optimizer"))
        return OptimizerConfig()
    if not isinstance(kind, str):
        p.errors.append(f"'optimizer.type' must be a string naming the optimizer ({', '.join(OPTIMIZERS)}), got "
                        f"{type(kind).__name__} {kind!r}.")
        return OptimizerConfig()
    if kind in DEEPSPEED_OPTIMIZERS:
        reason = ("communication-compressed (1-bit) optimizers are not part of ZeRO" if "One" in kind
                  else "zeroedu implements torch's Adam, AdamW and SGD")
        p.errors.append(f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zeroedu does not implement: "
                        f"{reason}; use one of {', '.join(OPTIMIZERS)}.")
        return OptimizerConfig()
    if kind not in OPTIMIZERS:
        close = difflib.get_close_matches(kind, list(OPTIMIZERS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        p.errors.append(f"'optimizer.type' must be one of {', '.join(OPTIMIZERS)}, got {kind!r}.{hint}")
        return OptimizerConfig()
    given = raw.get("params") or {}
    ps = "optimizer.params"
    spellings = keys_of(OptimizerParams)
    valid = sorted(n for n, (_, k) in spellings.items() if kind in k.for_types)
    if not isinstance(given, dict):
        p.errors.append(f"'{ps}' must be a JSON object (a dict), got {type(given).__name__} {given!r}.")
        given = {}
    mine = {}
    for k, v in given.items():
        if isinstance(k, str) and k in valid:
            mine[k] = v
        elif isinstance(k, str):
            _unknown(p, ps, k, valid)
        else:
            p.errors.append(f"'{ps}' has the key {k!r}, a {type(k).__name__}: config keys are strings.")
    params = parse(OptimizerParams, mine, ps, p)
    out = {k: getattr(params, k) for k in OptimizerParams.TORCH_KEYS if k in mine and getattr(params, k) is not None}
    for k in ("amsgrad", "nesterov"):
        if out.get(k) is False:
            del out[k]
    out.setdefault("lr", OptimizerParams.lr)
    if kind in ADAM:
        if params.torch_adam:
            out.setdefault("fused", False)   # DeepSpeed builds torch's Adam, whose CPU default is not fused
            p.notes.append("'optimizer.params.torch_adam': torch's Adam, as DeepSpeed builds it (not fused unless "
                           "'fused' is true).")
        if params.bias_correction is False:
            p.errors.append("'optimizer.params.bias_correction' false is not implemented (torch's Adam always "
                            "corrects the bias). Remove it.")
        adam_w_mode = params.adam_w_mode is not False
        if kind == "AdamW" and not adam_w_mode:
            p.errors.append("'optimizer.params.adam_w_mode' is false for AdamW: write type \"Adam\" for L2 weight "
                            "decay.")
        if kind == "Adam" and out.get("weight_decay", 0.0) > 0 and adam_w_mode:
            # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false: that is torch's AdamW.
            kind = "AdamW"
            p.notes.append("'optimizer.type' Adam with weight_decay: DeepSpeed's Adam decouples weight decay "
                           "(adam_w_mode defaults to true), so it runs as torch's AdamW here too.")
    return OptimizerConfig(type=kind, params=out)


def _allreduce_op(value: Any, name: str) -> str:
    """DeepSpeed's gradient_allreduce_op: "mean" (the default) or "sum", any case."""
    if not isinstance(value, str) or value.lower() not in ("mean", "sum"):
        raise ConfigError(f"'{name}' must be \"mean\" or \"sum\" (as DeepSpeed takes it), got {value!r}.")
    if value.lower() == "sum":
        raise ConfigError(f"'{name}' \"sum\" asks for gradients summed over ranks instead of averaged, which "
                          "zeroedu does not implement (every stage averages inside the collective): remove it, or "
                          "multiply the loss by the world size.")
    return value.lower()


def _unknown(p: Problems, section: str, name: str, valid: list[str]) -> None:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f" Did you mean '{section}.{close[0]}'?" if close else ""
    p.errors.append(f"unknown config key '{section}.{name}'.{hint} Valid keys here: {', '.join(valid)}.")


def _parse_scheduler(p: Problems, raw: Any, name: str) -> SchedulerConfig | None:
    """The schedule's parameters are declared once, in zeroedu.schedulers.PARAMS (with their defaults)."""
    from zeroedu import schedulers

    if not raw:
        return None
    if not isinstance(raw, dict):
        p.errors.append(f"'{name}' must be a JSON object (a dict), got {type(raw).__name__} {raw!r}.")
        return None
    for k in raw:
        if k not in ("type", "params"):
            _unknown(p, name, str(k), ["params", "type"])
    kind = raw.get("type")
    if kind == "auto":
        p.errors.append(auto_problem("scheduler.type", "\"WarmupDecayLR\" for its linear warmup and decay; the "
                                                       "others are " + ", ".join(schedulers.PARAMS)))
        return None
    if not isinstance(kind, str) or kind not in schedulers.PARAMS:
        close = difflib.get_close_matches(str(kind), list(schedulers.PARAMS), n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        p.errors.append(f"'scheduler.type' must be one of {', '.join(schedulers.PARAMS)}, got {kind!r}.{hint}")
        return None
    params = raw.get("params") or {}
    ps = "scheduler.params"
    if not isinstance(params, dict):
        p.errors.append(f"'{ps}' must be a JSON object (a dict), got {type(params).__name__} {params!r}.")
        params = {}
    allowed = schedulers.PARAMS[kind]
    out: dict[str, Any] = {}
    for k in params:
        if k not in allowed:
            _unknown(p, ps, str(k), sorted(allowed))
    for k, default in allowed.items():
        full = f"{ps}.{k}"
        if k not in params:
            if default is None and k not in ("cycle_second_step_size", "cycle_second_stair_count"):
                p.errors.append(f"'{full}' is required by {kind}: add it.")
            continue
        value = params[k]
        if value == "auto":
            p.errors.append(auto_problem(full, _SCHEDULER_FILLS.get(k)))
            continue
        if isinstance(value, list | tuple):
            p.errors.append(f"'{full}' must be one number: zeroedu's engine has one parameter group.")
            continue
        if k == "warmup_type":
            check = choice("log", "linear")
        elif k in schedulers.SWITCHES:
            check = boolean
        elif k in schedulers.COUNTS:
            lo = -1 if k == "last_batch_iteration" else 0 if "stair" in k or k == "decay_step_size" else 1
            check = integer(lo, 1 << 62)
        elif "lr" in k and "rate" not in k:
            check = number(0, 1e3, "No schedule needs more; a larger lr overflows fp32 within steps.")
        else:
            check = number(0, 1e6)
        try:
            out[k] = check(value, full)
        except ConfigError as e:
            p.errors.append(str(e))
    return SchedulerConfig(type=kind, params=out)


_SCHEDULER_FILLS = {"warmup_min_lr": "0", "warmup_max_lr": "--learning_rate", "warmup_num_steps": "--warmup_steps",
                    "total_num_steps": "the number of optimizer steps the Trainer will take"}


@dataclass(frozen=True)
class Config:
    AUTO_IS_DEFAULT = False
    train_micro_batch_size_per_gpu: int = key(1, integer(1), fill="--per_device_train_batch_size")
    gradient_accumulation_steps: int = key(1, integer(1), ds=1, fill="--gradient_accumulation_steps")
    # train_batch_size = micro x accumulation x world size: known once the world size is (Config.for_world).
    train_batch_size: int | None = key(None, integer(1),
                                       fill="per_device_train_batch_size x gradient_accumulation_steps x world size")
    gradient_clipping: float = key(0.0, number(0, 1e30), ds=1.0, fill="--max_grad_norm (1.0 by default)",
                                   differs="0: no clipping unless the config asks")
    optimizer: OptimizerConfig = key(parser=_parse_optimizer, default=OptimizerConfig)
    scheduler: SchedulerConfig | None = key(None, parser=_parse_scheduler)
    fp16: FP16Config = key(section=FP16Config)
    # "bfloat16" is DeepSpeed's older name for the section; DeepSpeed reads it only when "bf16" is absent
    # (get_bfloat16_config in deepspeed/runtime/precision_config.py), and so does zeroedu (load_config).
    bf16: BF16Config = key(section=BF16Config)
    zero_optimization: ZeroConfig = key(section=ZeroConfig)
    # Logging, as DeepSpeed's keys: every `steps_per_print` optimizer steps rank 0 prints step, loss, lr and loss
    # scale; wall_clock_breakdown and memory_breakdown print every step; comms_logger (see CommsLoggerConfig).
    steps_per_print: int | None = key(None, integer(1, null=True), ds=None)
    wall_clock_breakdown: bool = key(False, boolean, ds=False)
    memory_breakdown: bool = key(False, boolean, ds=False)
    comms_logger: CommsLoggerConfig = key(section=CommsLoggerConfig)
    dump_state: bool = key(False, boolean, ds=False)
    # zeroedu's own switch (not a DeepSpeed key): which collective implementation runs on gloo.
    comm_implementation: str = key("auto", choice("auto", "ring", "native"))
    activation_checkpointing: ActivationCheckpointingConfig = key(section=ActivationCheckpointingConfig)
    data_types: DataTypesConfig = key(section=DataTypesConfig)
    zeroedu: ZeroeduConfig = key(section=ZeroeduConfig)
    # DeepSpeed keys that change nothing here (noted), are taken at DeepSpeed's default only, or are refused.
    aio: dict | None = key(None, anything, note=f"'aio' tunes libaio's NVMe reads and writes (block size, queue "
                                                f"depth) {_GPU}; zeroedu's NVMe tier uses ordinary file reads and "
                                                f"writes")
    zero_allow_untested_optimizer: bool | None = key(
        None, boolean, ds=False, note="zeroedu takes Adam, AdamW and SGD only; any other optimizer is an error")
    zero_force_ds_cpu_optimizer: bool | None = key(
        None, boolean, ds=True, note="the CPU step is torch's own Adam here (DeepSpeed's CPUAdam is a C++ "
                                     "extension)")
    checkpoint: dict | None = key(
        None, refuse="loading a universal checkpoint (DeepSpeed's format for changing parallelism); zeroedu's "
                     "own checkpoints reshard to any world size (zeroedu.checkpoint)",
        off=_off("load_universal"))
    prescale_gradients: bool | None = key(None, only=False, ds=False, why="zeroedu averages inside the "
                                                                          "collective, after summing")
    gradient_predivide_factor: float | None = key(None, only=1.0, ds=1.0, why="zeroedu averages inside the "
                                                                              "collective, after summing")
    communication_data_type: str | None = key(None, only=None, ds=None, why="zeroedu reduces gradients in the "
                                                                            "compute dtype")
    sparse_gradients: bool | None = key(None, only=False, ds=False, why="zeroedu reduces dense gradients only")
    seq_parallel_communication_data_type: str | None = key(None, only=None, why="sequence parallelism is not "
                                                                                "implemented")
    dataloader_drop_last: bool | None = key(None, only=False, ds=False,
                                            why="the loader initialize(training_data=...) returns keeps a last, "
                                                "shorter batch, as DeepSpeed's does by default")
    gradient_allreduce_op: str | None = key(
        None, lambda v, name: _allreduce_op(v, name), ds="mean")
    disable_allgather: bool | None = key(None, only=False, ds=False, why="zeroedu's stages 1-2 always all-gather "
                                                                          "the updated parameters")
    managed_gradient_accumulation: bool | None = key(
        None, only=True, ds=True, why="zeroedu counts micro-steps itself: engine.step() at every micro-step, the "
                                      "optimizer steps at the accumulation boundary")
    disable_python_gc: Any = key(None, anything, ds=False, note="'disable_python_gc' changes when Python's garbage "
                                                                "collector runs, not what a step computes")
    log_level: Any = key(None, anything, ds=None, note="'log_level' sets DeepSpeed's logger; zeroedu prints its notes "
                                                       "and step lines on rank 0 (engine.log_lines keeps them)")
    timers: dict | None = key(None, anything, note="'timers' configures DeepSpeed's throughput timer; zeroedu's "
                                                   "wall_clock_breakdown and engine.timeline time each phase")
    expert_parallel: dict | None = key(None, refuse="expert parallelism is " + _PARALLEL)
    use_data_before_expert_parallelism: bool | None = key(None, only=False, ds=False,
                                                          why="expert parallelism is not implemented")
    pipeline: dict | None = key(None, refuse="pipeline parallelism (DeepSpeed's PipelineModule) is " + _PARALLEL)
    tensor_parallel: dict | None = key(None, refuse="tensor parallelism (AutoTP) is " + _PARALLEL,
                                       off=_off(at={"autotp_size": 1}))
    sequence_parallel_size: int | None = key(None, refuse="sequence parallelism (Ulysses) is " + _PARALLEL,
                                             off=lambda v: v == 1)
    moe: dict | None = key(None, refuse="mixture-of-experts layers and expert parallelism are " + _PARALLEL)
    compression_training: dict | None = key(None, refuse="model compression (quantization-aware training, "
                                                         "pruning) is not part of ZeRO")
    quantize_training: dict | None = key(None, refuse="quantization-aware training is not part of ZeRO")
    weight_quantization: dict | None = key(None, refuse="weight quantization for inference is not part of ZeRO")
    sparse_attention: dict | None = key(None, refuse="sparse attention kernels are " + _RECIPE)
    data_efficiency: dict | None = key(None, refuse="data sampling and routing are " + _RECIPE)
    curriculum_learning: dict | None = key(None, refuse="curriculum learning is " + _RECIPE)
    progressive_layer_drop: dict | None = key(None, refuse="progressive layer dropping is " + _RECIPE)
    eigenvalue: dict | None = key(None, refuse="eigenvalue-based layer scheduling is " + _RECIPE)
    autotuning: dict | None = key(None, refuse="the autotuner launches many experiments through DeepSpeed's "
                                               "launcher; `zeroedu plan` reasons about the same choices from the "
                                               "formulas")
    elasticity: dict | None = key(None, refuse="elastic training changes the batch with the world size; zeroedu's "
                                               "checkpoints reshard to any world size instead (zeroedu.checkpoint)")
    flops_profiler: dict | None = key(None, refuse="zeroedu measures bytes, not FLOPs (torch.profiler counts "
                                                   "FLOPs)")
    tensorboard: dict | None = key(None, refuse=_NO_MONITOR)
    wandb: dict | None = key(None, refuse=_NO_MONITOR)
    csv_monitor: dict | None = key(None, refuse=_NO_MONITOR)
    comet: dict | None = key(None, refuse=_NO_MONITOR)
    amp: dict | None = key(None, refuse="NVIDIA Apex AMP is not used here: write 'bf16' or 'fp16' instead")
    fp8: dict | None = key(None, refuse="fp8 training needs Transformer Engine on recent GPUs")
    torch_autocast: dict | None = key(None, refuse="zeroedu casts the model to the compute dtype ('bf16'/'fp16') "
                                                   "instead of autocasting")
    hybrid_engine: dict | None = key(None, refuse="the RLHF hybrid engine switches to inference kernels, outside "
                                                  "ZeRO training")
    compile: dict | None = key(None, refuse="DeepCompile (torch.compile of the engine's ZeRO passes) is not part of "
                                            "zeroedu", off=_off("deepcompile"))
    nebula: dict | None = key(None, refuse="Nebula is Azure's asynchronous checkpoint service")
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
        return dataclasses.asdict(self)

    def resolved(self) -> dict[str, Any]:
        """The config as this run uses it: every key's value, with the `zeroedu` knobs read from their modules
        (a checkpoint's metadata records it)."""
        out = json.loads(json.dumps(self.to_dict(), default=str))
        out["zeroedu"] = self.zeroedu.resolved()
        return out

    def for_world(self, world_size: int) -> Config:
        """The three batch sizes for `world_size` ranks, as DeepSpeed derives them: any two give the third (one
        alone: no accumulation). An inconsistent set is an error that shows the arithmetic."""
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
    refuse_non_finite(config)
    p = Problems()
    raw = dict(config)
    # "bfloat16" is DeepSpeed's older name for "bf16", read only when "bf16" is absent (get_bfloat16_config in
    # deepspeed/runtime/precision_config.py).
    old_bf16 = raw.pop("bfloat16", None)
    if "bfloat16" in config:
        p.notes.append("'bfloat16' is DeepSpeed's older name for 'bf16': " + (
            "ignored, since 'bf16' is given (as DeepSpeed does)." if "bf16" in raw else "read as 'bf16'."))
    zero_raw = raw.get("zero_optimization")
    if isinstance(zero_raw, dict):
        raw["zero_optimization"] = _map_deprecated_offload(p, zero_raw)
    cfg = parse(Config, raw, "", p)
    if "gradient_clipping" not in config:
        # DeepSpeed 0.19.8 clips a config that leaves the key out: GRADIENT_CLIPPING_DEFAULT = 1.0
        # (runtime/constants.py). zeroedu keeps 0 (saved lesson outputs count the collectives of unclipped steps),
        # and says so, since the same config would then train differently under DeepSpeed.
        p.notes.append("'gradient_clipping' is left out: zeroedu does not clip, but DeepSpeed 0.19.8 clips the "
                       "gradient norm at 1.0 when the key is left out, so its losses differ once the norm exceeds "
                       "1. Write \"gradient_clipping\": 1.0 for DeepSpeed's result, or 0 for no clipping in both.")
    if "bfloat16" in config and "bf16" not in config:
        cfg = dataclasses.replace(cfg, bf16=parse(BF16Config, old_bf16, "bfloat16", p))
    if "optimizer" not in p.given:
        cfg = dataclasses.replace(cfg, optimizer=OptimizerConfig())
    zc = cfg.zero_optimization
    if zc.stage3_max_reuse_distance is None:   # null: 0, as left out
        cfg = dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zc, stage3_max_reuse_distance=0))
    _check_across(p, cfg, config)
    cfg = dataclasses.replace(cfg, batch_keys_given=tuple(k for k in _BATCH_KEYS if k in p.given),
                              notes=tuple(dict.fromkeys(p.notes)))
    p.raise_if_any()
    return cfg


def _map_deprecated_offload(p: Problems, raw: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed 0.19.8 still maps cpu_offload -> offload_optimizer and cpu_offload_param -> offload_param
    ({"device": "cpu"} when true; deepspeed/runtime/zero/config.py) and refuses either next to its new key."""
    out = dict(raw)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in raw and new in raw:
            p.errors.append(f"'zero_optimization.{old}' and 'zero_optimization.{new}' are both given: '{old}' is the "
                            f"deprecated spelling of '{new}' (DeepSpeed refuses the two together too). Keep '{new}'.")
            del out[old]
        elif raw.get(old) is True:
            out[new] = {"device": "cpu"}
    return out


def _check_across(p: Problems, cfg: Config, raw: dict[str, Any]) -> None:
    """The rules that tie keys together (each key alone was checked where it is declared)."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        p.errors.append("'fp16.enabled' and 'bf16.enabled' are both true: choose one precision.")
    zc, s = cfg.zero_optimization, "zero_optimization"
    zraw = raw.get(s) if isinstance(raw.get(s), dict) else {}
    stage = zc.stage
    if zc.offload_optimizer.device != "none" and stage == 0:
        p.errors.append(f"'{s}.offload_optimizer' needs ZeRO stage 1, 2 or 3 (the optimizer state must be "
                        f"partitioned to be offloaded); got stage 0. Set '{s}.stage' to 1 or more.")
    if zc.offload_param.device != "none" and stage != 3:
        p.errors.append(f"'{s}.offload_param' works only at stage 3 (only stage 3 partitions parameters); got "
                        f"stage {stage}. Set '{s}.stage' to 3 or remove offload_param.")
    for name, off in (("offload_optimizer", zc.offload_optimizer), ("offload_param", zc.offload_param)):
        if off.device == "nvme" and not off.nvme_path:
            p.errors.append(f"'{s}.{name}.device' is 'nvme' but '{s}.{name}.nvme_path' is not set: name a folder.")
    if (zc.zero_quantized_weights or zc.zero_quantized_gradients or zc.zero_hpz_partition_size > 1) and stage != 3:
        p.errors.append(f"ZeRO++ ('zero_quantized_weights', 'zero_quantized_gradients', "
                        f"'zero_hpz_partition_size') works at stage 3 only; got stage {stage}.")
    if zc.compute_grad_norm is False and (stage not in (1, 2) or cfg.gradient_clipping > 0):
        p.errors.append(f"'{s}.compute_grad_norm' false needs stage 1 or 2 and 'gradient_clipping' 0 (DeepSpeed "
                        f"refuses it otherwise too: clipping needs the norm); got stage {stage}, gradient_clipping "
                        f"{cfg.gradient_clipping:g}. Remove it.")
    if stage == 3 and "allgather_bucket_size" in zraw:
        p.notes.append(f"'{s}.allgather_bucket_size' is for stages 1-2; stage 3 gathers parameters unit by unit, "
                       "sized by stage3_prefetch_bucket_size.")
    if stage == 0 and zraw.get("reduce_scatter") is False:
        p.notes.append(f"'{s}.reduce_scatter' false changes nothing at stage 0, which all-reduces anyway.")
    if zraw.get("contiguous_gradients") is False:
        if stage < 2:
            p.notes.append(f"'{s}.contiguous_gradients' false changes nothing at stage {stage}: stages 0-1 keep the "
                           "gradients in one flat buffer, which is contiguous by construction.")
        else:
            p.notes.append(f"'{s}.contiguous_gradients' false changes nothing at stage {stage}: zeroedu copies each "
                           "bucket's gradients into a buffer made for that bucket and freed once it is reduced, "
                           "with the switch on or off (DeepSpeed, with it false, reduces the gradients where they "
                           "lie instead of copying them into one preallocated buffer).")
    if "sub_group_size" in zraw and zc.offload_optimizer.device != "none":
        p.notes.append(f"'{s}.sub_group_size' is not applied with offload_optimizer: the host step runs over the "
                       "whole shard at once (the NVMe tier moves one bucket's piece at a time, whatever this says). "
                       "DeepSpeed reads it at stage 3 (ZeRO-3 Offload and ZeRO-Infinity) only.")
    if cfg.fp16.enabled and cfg.fp16.dynamic and cfg.fp16.min_loss_scale <= 0:
        p.errors.append("'fp16.min_loss_scale' must be > 0 with dynamic loss scaling (loss_scale 0): it is the floor "
                        "the scale halves down to, and at 0 the loss becomes 0 (DeepSpeed refuses it too). Write 1.")
    if cfg.fp16.auto_cast and not cfg.fp16.enabled:
        # DeepSpeed 0.19.8's engine.forward asks only fp16.auto_cast (runtime/engine.py, fp16_auto_cast).
        p.notes.append("'fp16.auto_cast' is true with fp16 off: zeroedu leaves the inputs as they are, but DeepSpeed "
                       "0.19.8 still casts the forward's floating-point inputs to fp16, which a bf16 or fp32 model "
                       "then refuses (\"mat1 and mat2 must have the same dtype\"). Set it false to run the same "
                       "under both.")
    ac, a = cfg.activation_checkpointing, "activation_checkpointing"
    for needs in ("cpu_checkpointing", "contiguous_memory_optimization"):
        if getattr(ac, needs) and not ac.partition_activations:
            p.errors.append(f"'{a}.{needs}' acts on partitioned checkpoints (as in DeepSpeed): set "
                            f"'{a}.partition_activations' to true too (without tensor parallelism a partition "
                            f"is the whole checkpoint).")
    araw = raw.get(a) if isinstance(raw.get(a), dict) else {}
    auto = araw.get("number_checkpoints") == "auto"   # already reported as "auto"
    if ac.contiguous_memory_optimization and ac.number_checkpoints is None and not auto:
        p.errors.append(f"'{a}.contiguous_memory_optimization' needs '{a}.number_checkpoints': how many "
                        f"checkpoints one forward makes (the contiguous buffer has that many slots).")


__all__ = ["Config", "ConfigError", "OffloadConfig", "load_config"]
