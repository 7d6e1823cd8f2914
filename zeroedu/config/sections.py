"""Every config key, declared once: the sections of DeepSpeed's JSON as frozen dataclasses, one field per key.

Each field's `key(...)` (zeroedu.config.declare) is the whole truth about its key: check and bounds, DeepSpeed
0.19.8's default (`ds`; tests/test_config_declared.py compares them with DeepSpeed's own config classes), why
zeroedu's default differs where it does, and for DeepSpeed keys zeroedu does not implement, whether they are
noted (accepted, they change nothing here), accepted at one value, or refused with the reason unless switched off.

Bounds come from DeepSpeed's pydantic models where it has them (gt=0 for reduce_bucket_size, ge=0 for the stage-3
sizes and sub_group_size, ...). Where DeepSpeed has none, a bound keeps a value from exhausting memory or
overflowing the arithmetic (lr, loss_scale, buffer_count); each says why in its error.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any

from zeroedu.config.declare import (
    ConfigError,
    anything,
    boolean,
    choice,
    integer,
    key,
    number,
    optional,
)

_GPU = "on a GPU machine"
PIN_NOTE = ("'{where}.pin_memory' page-locks the host buffers so copies to and from the GPU run at full PCIe "
            "speed and overlap compute " + _GPU + "; on CPU ranks there is nothing to pin")
E8 = 100_000_000
TOP = 1e3   # the largest learning rate taken: a step of lr x 1 moves a weight by 1000; above, fp32 overflows soon


def _is(value: Any) -> Any:
    return lambda v: v == value


LEAF_MODULE_FIELDS = ("classes", "names", "name_suffixes")


def leaf_module_entries(value: Any, name: str) -> dict[str, list[str]]:
    """zero_optimization.leaf_module as DeepSpeed 0.19.8 reads it (runtime/zero/leaf_module_config.py): an object
    with `classes` (class names, plain or module-qualified), `names` (names from model.named_modules()) and
    `name_suffixes`, each a string or a list of strings; a field left out keeps DeepSpeed's default."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"'{name}' must be an object such as {{\"classes\": [\"MyMoEBlock\"]}} (fields "
                          f"{', '.join(LEAF_MODULE_FIELDS)}), got {value!r}.")
    unknown = sorted(set(value) - set(LEAF_MODULE_FIELDS))
    if unknown:
        raise ConfigError(f"'{name}' has no field {', '.join(map(repr, unknown))}: its fields are "
                          f"{', '.join(LEAF_MODULE_FIELDS)} (DeepSpeed's DeepSpeedZeroLeafModuleConfig).")
    out = {}
    for field, v in value.items():
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"'{name}.{field}' must be a string or a list of strings, got {v!r}.")
        out[field] = list(dict.fromkeys(v))
    return out


def _betas(value: Any, name: str) -> tuple[float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in value):
        raise ConfigError(f"'{name}' must be two numbers in [0, 1), got {value!r}.")
    return (float(value[0]), float(value[1]))


def _ops(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(o, str) for o in value):
        raise ConfigError(f"'{name}' must be a list of collective names, got {value!r}.")
    return tuple(value)


def _path(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"'{name}' must be a path string, got {value!r}.")
    return value


# ---- optimizer and scheduler --------------------------------------------------------------------------------

ADAM = ("Adam", "AdamW")
OPTIMIZERS = ("Adam", "AdamW", "SGD")
# DeepSpeed's own optimizers (optimizer.type) that zeroedu refuses: it implements torch's Adam, AdamW and SGD.
DEEPSPEED_OPTIMIZERS = {"OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lion", "MuAdam", "MuAdamW", "MuSGD",
                        "Muon", "Adagrad", "CPUAdam", "FusedAdam"}


@dataclass(frozen=True)
class OptimizerParams:
    """`optimizer.params`: torch's hyperparameters, and DeepSpeed's switches for its Adam (`for_types`)."""

    lr: float = key(1e-3, number(0, TOP, "No schedule needs more; a larger lr overflows fp32 within steps."),
                    fill="--learning_rate", for_types=OPTIMIZERS)
    betas: tuple[float, float] | None = key(None, _betas, fill="[--adam_beta1, --adam_beta2]", for_types=ADAM)
    eps: float | None = key(None, number(0, 1), fill="--adam_epsilon", for_types=ADAM)
    weight_decay: float | None = key(None, number(0, TOP), fill="--weight_decay", for_types=OPTIMIZERS)
    amsgrad: bool | None = key(None, boolean, for_types=ADAM)
    momentum: float | None = key(None, number(0, 1), for_types=("SGD",))
    nesterov: bool | None = key(None, boolean, for_types=("SGD",))
    dampening: float | None = key(None, number(0, 1), for_types=("SGD",))
    # DeepSpeed's spellings in an Adam section: adam_w_mode (Adam's weight decay is decoupled unless it is false),
    # torch_adam (torch's kernel instead of DeepSpeed's FusedAdam), bias_correction (always on in torch).
    adam_w_mode: bool | None = key(None, boolean, ds=True, for_types=ADAM)
    torch_adam: bool | None = key(None, boolean, ds=False, for_types=ADAM)
    bias_correction: bool | None = key(None, boolean, ds=True, for_types=ADAM)
    # torch's switch, which DeepSpeed passes to torch's Adam with torch_adam. Left out: fused, as DeepSpeed's
    # default FusedAdam (one kernel per flat piece); with torch_adam, torch's own default on CPU (not fused: the
    # for-loop kernel), so a run matches DeepSpeed's optimizer bit for bit either way.
    fused: bool | None = key(None, boolean, for_types=ADAM)

    TORCH_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "nesterov", "dampening", "fused")


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "Adam"
    params: dict[str, Any] = dataclasses.field(default_factory=lambda: {"lr": 1e-3})

    @property
    def name(self) -> str:
        return self.type.lower()


@dataclass(frozen=True)
class SchedulerConfig:
    """`scheduler`: one of DeepSpeed's schedules (zeroedu.schedulers, which declares each one's parameters),
    stepped by engine.step()."""

    type: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---- precision ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FP16Config:
    """fp16 loss scaling as DeepSpeed spells it: loss_scale 0 is dynamic, any other value a fixed scale."""

    AUTO_IS_DEFAULT = True
    enabled: bool = key(False, boolean, ds=False, fill="--fp16")
    loss_scale: float = key(0.0, number(0, 2.0 ** 64, "A fixed scale above 2^64 turns every fp16 gradient into "
                                                      "inf, so every step would be skipped: use 0 (dynamic)."),
                            ds=0)
    initial_scale_power: int = key(16, integer(-64, 64), ds=16)   # DeepSpeed: any int; 2^-1 is a scale too
    loss_scale_window: int = key(1000, integer(1), ds=1000)
    hysteresis: int = key(2, integer(1, why="Below 1 the scale never falls (DeepSpeed's scaler counts down to exactly "
                                            "1), so every overflowing step would be skipped for ever."), ds=2)
    consecutive_hysteresis: bool = key(False, boolean, ds=False)
    min_loss_scale: float = key(1.0, number(0, 2.0 ** 64), ds=1)
    auto_cast: bool = key(False, boolean, ds=False)
    fp16_master_weights_and_grads: bool | None = key(
        None, refuse="zeroedu keeps fp32 master weights (the K = 12 of the paper)", off=_is(False))

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclass(frozen=True)
class BF16Config:
    AUTO_IS_DEFAULT = True
    enabled: bool = key(False, boolean, ds=False, fill="--bf16")
    immediate_grad_update: bool | None = key(
        None, refuse="zeroedu accumulates gradients in the compute dtype until the step", off=_is(False))
    check_grad_overflow: bool | None = key(
        None, only=False, ds=True, why="bf16 steps are not checked for overflow here (DeepSpeed 0.19.8 checks them "
                                       "by default and skips a step whose gradients hold inf or NaN)")
    bf16_master_weights_and_grads: bool | None = key(
        None, refuse="zeroedu keeps fp32 master weights (the K = 12 of the paper)", off=_is(False))
    bf16_optimizer_states: bool | None = key(
        None, refuse="zeroedu keeps the optimizer state in fp32", off=_is(False))


@dataclass(frozen=True)
class DataTypesConfig:
    """`data_types`: grad_accum_dtype is the dtype gradients accumulate in across micro-steps ("fp32", "bf16",
    "fp16"); None means the compute dtype, as without the section."""

    grad_accum_dtype: str | None = key(None, optional(choice("fp32", "bf16", "fp16")), ds=None)


# ---- logging --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CommsLoggerConfig:
    """`comms_logger`: verbose prints each collective of a step after it; log_summary() prints the totals."""

    AUTO_IS_DEFAULT = True
    enabled: bool = key(False, boolean, ds=False)
    verbose: bool = key(False, boolean, ds=False)
    prof_all: bool = key(True, boolean, ds=True)
    prof_ops: tuple[str, ...] = key((), _ops, ds=[])
    debug: bool = key(False, boolean, ds=False)


# ---- activation checkpointing ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """`activation_checkpointing`: how zeroedu.checkpointing.checkpoint keeps a checkpoint (ZeRO-R's P_a).

    As in DeepSpeed, cpu_checkpointing and contiguous_memory_optimization act on the partitioned checkpoint, so
    they need partition_activations; contiguous_memory_optimization needs number_checkpoints (the buffer's slots).
    DeepSpeed reads this section key by key (not with pydantic), so "auto" is not its default here.
    """

    AUTO_FILL = "nothing: it fills no activation_checkpointing key, so write true or false (a count for " \
                "number_checkpoints)"

    partition_activations: bool = key(False, boolean, ds=False)
    cpu_checkpointing: bool = key(False, boolean, ds=False)
    contiguous_memory_optimization: bool = key(False, boolean, ds=False)
    number_checkpoints: int | None = key(None, integer(1, null=True), ds=None)
    synchronize_checkpoint_boundary: bool = key(False, boolean, ds=False)
    profile: bool = key(False, boolean, ds=False)


# ---- ZeRO -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OffloadConfig:
    """`offload_optimizer` / `offload_param`: where a tier lives. Parsed here, used by zeroedu.offload.

    buffer_count: host buffers for NVMe, each the size of the largest sub-group piece: sub-groups of optimizer
    state in flight (offload_optimizer, DeepSpeed's default 4), parameter pieces on their way between NVMe and the
    device (offload_param, default 5). pin_memory: page-locked host buffers (used only when the device is a GPU).
    """

    AUTO_IS_DEFAULT = True
    device: str = key("none", choice("none", "cpu", "nvme"), ds="none")
    pin_memory: bool = key(False, boolean, ds=True, note=PIN_NOTE, note_if=bool,
                           differs="nothing is pinned on CPU ranks")
    nvme_path: str | None = key(None, _path, ds=None)
    buffer_count: int = key(4, integer(1, 64, "Each buffer holds a whole piece in host memory; more than a few "
                                              "in flight buy nothing (DeepSpeed's defaults are 4 and 5)."), ds=4)
    fast_init: bool | None = key(None, anything, ds=False, note=f"'fast_init' speeds up creating the optimizer "
                                                                f"state on NVMe {_GPU}; the result is the same")
    pipeline_read: bool | None = key(None, anything, ds=False, note=f"'pipeline_read' overlaps NVMe reads with the "
                                     f"step {_GPU}; here reads are already overlapped with the previous "
                                     f"sub-group's step")
    pipeline_write: bool | None = key(None, anything, ds=False, note=f"'pipeline_write' overlaps NVMe writes with "
                                                                     f"the step {_GPU}")
    pipeline: bool | None = key(None, anything, note=f"'pipeline' overlaps NVMe reads and writes with the step {_GPU}")
    cpuadam_cores_perc: float | None = key(
        None, number(0, 1), ds=0.8, note="'cpuadam_cores_perc' is the share of CPU cores DeepSpeed's CPUAdam uses "
                                         "with super_offload; the CPU step here is torch's Adam on torch's own "
                                         "threads")
    ratio: float | None = key(None, refuse="partial optimizer offload (ZeRO-Offload++) is not implemented: the "
                                           "whole shard moves", off=_is(1.0))
    super_offload: bool | None = key(
        None, only=False, ds=False, why="SuperOffload is DeepSpeed's offload for Superchips (Grace Hopper's CPU and "
                                        "GPU sharing one coherent memory); zeroedu's CPU tier is the ordinary one")


@dataclass(frozen=True)
class OffloadParamConfig:
    """`offload_param` (stage 3): see OffloadConfig; DeepSpeed's default buffer_count here is 5."""

    AUTO_IS_DEFAULT = True
    device: str = key("none", choice("none", "cpu", "nvme"), ds="none")
    pin_memory: bool = key(False, boolean, ds=True, note=PIN_NOTE, note_if=bool,
                           differs="nothing is pinned on CPU ranks")
    nvme_path: str | None = key(None, _path, ds=None)
    buffer_count: int = key(5, integer(1, 64, "Each buffer holds a whole piece in host memory; more than a few "
                                              "in flight buy nothing (DeepSpeed's defaults are 4 and 5)."), ds=5)
    buffer_size: int | None = key(None, integer(0), ds=E8, note=f"'buffer_size' sizes the pinned staging buffers "
                                                                f"for NVMe parameter reads {_GPU}")
    max_in_cpu: int | None = key(None, integer(0), ds=10 * E8, note=f"'max_in_cpu' keeps up to this many parameters "
                                                                    f"in host memory before NVMe {_GPU}")


def _deprecated_offload(new: str) -> dict:
    return dict(note=f"'{{where}}.cpu_offload{'_param' if new == 'offload_param' else ''}' is deprecated in "
                     f"DeepSpeed: write \"{new}\": {{{{\"device\": \"cpu\"}}}} (read as that here when true; false: "
                     f"no offload).")


@dataclass(frozen=True)
class ZeroConfig:
    AUTO_IS_DEFAULT = True
    stage: int = key(0, integer(0, 3), ds=0)
    # None (the key left out): zeroedu sizes it to the model, where DeepSpeed uses fixed element counts (reduce
    # 5e8, prefetch 5e7, max live 1e9); see zeroedu.stages.sizing. A value given is used as given, as in DeepSpeed.
    reduce_bucket_size: int | None = key(None, integer(1, null=True), ds=5 * E8, fill="hidden_size x hidden_size",
                                         differs="sized to the model (zeroedu.stages.sizing)")
    # None (zeroedu's default): after the step, one all-gather for every reduce bucket where it packs nothing
    # (Comm.packs_nothing: each piece lands in place), else one per bucket; a number: all-gathers of at most this
    # many elements, whatever the reduce buckets are, as DeepSpeed's stages 1-2 cut them. (DeepSpeed's ge=0 lets
    # 0 through, and its stages 1-2 then divide by it.)
    allgather_bucket_size: int | None = key(None, integer(1, null=True), ds=5 * E8,
                                            differs="every bucket in one all-gather where that packs nothing")
    # True at every stage here; DeepSpeed's default is None, made True at stage 3 only (`overlap_comm_valid` in
    # deepspeed/runtime/zero/config.py), so its stages 1-2 reduce one bucket after the other unless the config says.
    overlap_comm: bool = key(True, boolean, ds=None, differs="true at every stage (DeepSpeed: at stage 3 only)")
    # Accepted and changes nothing: stages 0-1 reduce views of one flat gradient buffer, and stages 2-3 copy each
    # bucket into a buffer of its own (made when the bucket is full, freed once reduced) with the switch on or off.
    contiguous_gradients: bool = key(True, boolean, ds=True)
    # Stages 1-3: reduce-scatter each gradient bucket (True), or all-reduce it and keep this rank's piece (False).
    reduce_scatter: bool = key(True, boolean, ds=True)
    # Stages 1-2: True all-reduces each gradient bucket and keeps this rank's piece, as DeepSpeed's `average_tensor`
    # (stage_1_and_2.py) does at its default (true since 0.12.4): 3 Psi elements a step with the parameter all-gather.
    # zeroedu's default is False, the ZeRO paper's reduce-scatter (2 Psi elements a step, what DDP's all-reduce
    # moves), because the course teaches the paper's volumes; set true to send DeepSpeed's bytes. DeepSpeed's stage 3
    # has no such key: there it changes nothing (tests/test_deepspeed_facts.py).
    use_multi_rank_bucket_allreduce: bool = key(
        False, boolean, ds=True, differs="false: the paper's reduce-scatter (2 Psi elements a step); true sends "
                                         "DeepSpeed's all-reduced buckets (3 Psi)")
    # Without offload_optimizer the optimizer step runs over sub-groups of master pieces of at most this many
    # elements, one at a time (0: each piece alone, as DeepSpeed's stage 3 makes each parameter its own sub-group).
    # With offload_optimizer it is not applied: a note says so.
    sub_group_size: int = key(1_000_000_000, integer(0), ds=10 * E8)
    # DeepSpeed skips the norm with it false (stages 1-2, no clipping); zeroedu computes it only where clipping or
    # fp16's overflow check needs it, so either value gives the same steps.
    compute_grad_norm: bool | None = key(None, boolean, ds=True)
    round_robin_gradients: bool = key(
        False, boolean, ds=False, note_if=bool,
        note="with CPU offload DeepSpeed reorders a bucket's gradients so that every rank copies an equal share to "
             "the host; here every rank's piece of every bucket is already the same size (flat layout), so there "
             "is nothing to balance")
    # DeepSpeed's pydantic field names are prefetch_bucket_size, ...; the stage3_ spellings are its aliases.
    stage3_prefetch_bucket_size: int | None = key(None, integer(0, null=True), ds=5 * E8 // 10,
                                                  aliases=("prefetch_bucket_size",),
                                                  fill="0.9 x hidden_size x hidden_size",
                                                  differs="sized to the model (zeroedu.stages.sizing)")
    stage3_param_persistence_threshold: int = key(100_000, integer(0), ds=100_000,
                                                  aliases=("param_persistence_threshold",),
                                                  fill="10 x hidden_size")
    stage3_max_live_parameters: int | None = key(None, integer(0, null=True), ds=10 * E8,
                                                 aliases=("max_live_parameters",),
                                                 differs="twice the prefetch size (zeroedu.stages.sizing)")
    # A unit whose next use (its own backward) comes before this many elements of other modules' parameters are
    # used stays gathered from its last forward use to its backward (stage3.py). 0: none does.
    stage3_max_reuse_distance: int | None = key(0, integer(0, null=True), ds=10 * E8,
                                                aliases=("max_reuse_distance",),
                                                differs="0: every unit is released after its forward, the 3 Psi "
                                                        "of the ZeRO paper")
    stage3_gather_16bit_weights_on_model_save: bool = key(
        False, boolean, ds=False,
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    offload_optimizer: OffloadConfig = key(section=OffloadConfig)
    offload_param: OffloadParamConfig = key(section=OffloadParamConfig)
    cpu_offload: bool | None = key(None, boolean, **_deprecated_offload("offload_optimizer"))
    cpu_offload_param: bool | None = key(None, boolean, **_deprecated_offload("offload_param"))
    zero_quantized_weights: bool = key(False, boolean, ds=False)
    zero_quantized_gradients: bool = key(False, boolean, ds=False)
    # DeepSpeed's ge=0; 0 and 1 both mean no secondary partition there.
    zero_hpz_partition_size: int = key(1, integer(0), ds=1)
    memory_efficient_linear: bool | None = key(
        None, boolean, ds=True, note_if=bool,
        note="'memory_efficient_linear' (DeepSpeed's default) swaps torch.nn.Linear's autograd function so that "
             "stage 3 keeps no gathered weight for backward; zeroedu's stage 3 releases and re-gathers weights "
             "itself, with the same results")
    # Noted: they change nothing here; the note says why.
    elastic_checkpoint: bool | None = key(None, anything, ds=False,
                                          note="zeroedu's checkpoints load at any world size anyway "
                                               "(zeroedu.checkpoint)")
    stage3_model_persistence_threshold: int | None = key(
        None, integer(0), aliases=("model_persistence_threshold",),
        note="not applied: DeepSpeed caps the total elements kept whole by stage3_param_persistence_threshold (no "
             "cap by default); here every unit under that threshold stays whole, however many there are: lower "
             "the threshold to keep fewer")
    cpu_offload_use_pin_memory: bool | None = key(
        None, anything, note="DeepSpeed's deprecated 'cpu_offload_use_pin_memory' sets nothing in DeepSpeed 0.19.8 "
                             f"either; write 'pin_memory' inside offload_optimizer or offload_param (it matters "
                             f"{_GPU} only)")
    # At DeepSpeed's default only.
    ignore_unused_parameters: bool | None = key(None, only=True, ds=True, why="zeroedu always reduces zeros for a "
                                                                              "parameter without a gradient")
    load_from_fp32_weights: bool | None = key(None, only=True, ds=True, why="zeroedu's checkpoints always restore "
                                                                            "the fp32 master weights")
    allgather_partitions: bool | None = key(None, only=True, ds=True, why="zeroedu always all-gathers the updated "
                                                                          "parameters")
    log_trace_cache_warnings: bool | None = key(None, only=False, ds=False, why="zeroedu's stage 3 re-records its "
                                                                                "trace only on the first step")
    parameter_alignment: bool | None = key(None, only=False, ds=False, why="zeroedu pads each bucket to a multiple "
                                                                           "of N, not each parameter to 16 bytes")
    stage3_use_all_reduce_for_fetch_params: bool | None = key(
        None, only=False, ds=False, aliases=("use_all_reduce_for_fetch_params",),
        why="zeroedu gathers parameters with all-gather, the ZeRO paper's collective, at (N-1)/N of the bytes")
    override_module_apply: bool | None = key(
        None, boolean, ds=True, note_if=bool,
        note="DeepSpeed wraps nn.Module.apply so that a function applied to a ZeRO-3 model sees gathered weights; "
             "zeroedu does not: call model.apply before initialize, or on engine.module inside engine.gathered()")
    enable_sanity_checks: bool | None = key(None, boolean, ds=False, note_if=bool,
                                            note="DeepSpeed's internal stage-3 sanity checks do not exist here")
    save_muon_momentum_buffer_in_memory: bool | None = key(
        None, boolean, ds=False, note_if=bool, note="Muon is not one of zeroedu's optimizers, so there is no Muon "
                                                    "momentum buffer to keep")
    # DeepSpeed's default is an object whose `classes` are three Hugging Face MoE blocks; null here means that
    # default, applied at initialize (zeroedu.zero.apply_leaf_module_config).
    leaf_module: dict | None = key(None, lambda v, name: leaf_module_entries(v, name))
    # Refused: they ask for something zeroedu does not do.
    pipeline_loading_checkpoint: bool | None = key(None, refuse="loading a checkpoint in pipeline mode belongs to "
                                                                "pipeline parallelism", off=_is(False))
    zenflow: dict | None = key(None, refuse="ZenFlow (update the most important gradients on the device at once and "
                                            "the rest later on the CPU) changes the optimizer's schedule; zeroedu "
                                            "steps every parameter at every step")
    mics_shard_size: int | None = key(None, refuse="MiCS (sharding within sub-groups of ranks) is a different "
                                                   "design from ZeRO's", off=lambda v: v in (-1, 0))
    mics_hierarchical_params_gather: bool | None = key(None, refuse="MiCS (sharding within sub-groups of ranks) is "
                                                                    "a different design", off=_is(False))
    legacy_stage1: bool | None = key(None, refuse="the legacy stage-1 implementation does not exist here",
                                     off=_is(False))
    zero_quantized_nontrainable_weights: bool | None = key(
        None, refuse="ZeRO++ here quantizes trainable weights only", off=_is(False))
    stage3_module_granularity_threshold: int | None = key(
        None, refuse="zeroedu's stage-3 unit is always one module's own parameters", off=_is(0),
        aliases=("module_granularity_threshold",))
    grad_hooks: bool | None = key(None, refuse="zeroedu's gradient hooks are always on (every stage reduces from "
                                               "them)", off=_is(True))
    stage3_allgather_sequential: bool | None = key(
        None, only=False, ds=False, aliases=("allgather_sequential",),
        why="zeroedu gathers a unit's parameters in one collective")


# ---- zeroedu's own knobs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ZeroeduConfig:
    """`zeroedu`: the knobs that are module attributes (zeroedu.zeropp.WEIGHT_BITS, zeroedu.offload.CPU_ADAM,
    ...), settable from the config. DeepSpeed ignores a top-level key it does not read, so a config carrying this
    section still runs under DeepSpeed. A key left out keeps the module's value (a notebook may have set it);
    `resolved()` reads what a run used, and checkpoints record it."""

    zeropp_weight_bits: int | None = key(None, optional(choice(4, 8)), knob="zeroedu.engine.extras.zeropp:WEIGHT_BITS")
    zeropp_weight_block: int | None = key(None, integer(1, 1 << 24, null=True),
                                          knob="zeroedu.engine.extras.zeropp:WEIGHT_BLOCK")
    zeropp_grad_bits: int | None = key(None, optional(choice(4, 8)), knob="zeroedu.engine.extras.zeropp:GRAD_BITS")
    zeropp_grad_block: int | None = key(None, integer(1, 1 << 24, null=True),
                                        knob="zeroedu.engine.extras.zeropp:GRAD_BLOCK")
    node_size: int | None = key(None, integer(1, 1 << 16, null=True), knob="zeroedu.engine.extras.zeropp:NODE_SIZE")
    cpu_adam: str | None = key(None, optional(choice("fused", "foreach", "loop")),
                               knob="zeroedu.engine.extras.offload:CPU_ADAM")
    ledger_max_entries: int | None = key(None, integer(1, null=True), knob="zeroedu.comm.ledger:Ledger.max_entries")
    ledger_max_steps: int | None = key(None, integer(1, null=True), knob="zeroedu.comm.ledger:Ledger.max_steps")
    timeline_keep: int | None = key(None, integer(1, null=True), knob="zeroedu.engine:TIMELINE_KEEP")

    @staticmethod
    def _target(knob: str) -> tuple[Any, str]:
        module, _, attr = knob.partition(":")
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def apply(self) -> None:
        """Set the module knobs this section gives (in this process: each rank applies its own)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                owner, name = self._target(f.metadata["key"].knob)
                setattr(owner, name, value)

    def resolved(self) -> dict[str, Any]:
        """Every knob's value in this process now: what a run with this config uses."""
        out = {}
        for f in dataclasses.fields(self):
            owner, name = self._target(f.metadata["key"].knob)
            out[f.name] = getattr(owner, name)
        return out


def knob_names() -> dict[str, str]:
    """'module:ATTRIBUTE' -> the `zeroedu` key that sets it."""
    return {f.metadata["key"].knob: f.name for f in dataclasses.fields(ZeroeduConfig)}

