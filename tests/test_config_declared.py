"""The config declared once, checked against DeepSpeed 0.19.8's own config classes: every key of DeepSpeed's
pydantic sections is declared here, with DeepSpeed's default and bounds; what DeepSpeed accepts zeroedu accepts;
every numeric key is bounded, with an error that names the key, the problem and the fix; the `zeroedu` section
sets the module knobs and a checkpoint records the resolved config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zeroedu.config import (
    BF16Config,
    CommsLoggerConfig,
    ConfigError,
    FP16Config,
    OffloadConfig,
    OffloadParamConfig,
    ZeroConfig,
    ZeroeduConfig,
    load_config,
)
from zeroedu.config.declare import MISSING, keys_of

ds_zero = pytest.importorskip("deepspeed.runtime.zero.config")
ds_offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
ds_precision = pytest.importorskip("deepspeed.runtime.precision_config")
ds_comm = pytest.importorskip("deepspeed.comm.config")

PAIRS = [(ZeroConfig, ds_zero.DeepSpeedZeroConfig, "zero_optimization"),
         (OffloadConfig, ds_offload.DeepSpeedZeroOffloadOptimizerConfig, "zero_optimization.offload_optimizer"),
         (OffloadParamConfig, ds_offload.DeepSpeedZeroOffloadParamConfig, "zero_optimization.offload_param"),
         (FP16Config, ds_precision.DeepSpeedFP16Config, "fp16"),
         (BF16Config, ds_precision.DeepSpeedBF16Config, "bf16"),
         (CommsLoggerConfig, ds_comm.CommsLoggerConfig, "comms_logger")]


def err(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    return str(e.value)


def nest(section: str, body: dict) -> dict:
    out: dict = body
    for part in reversed(section.split(".")):
        out = {part: out}
    if section.startswith("zero_optimization"):
        out["zero_optimization"].setdefault("stage", 3)
    return out


def ds_names(model) -> dict[str, str]:
    """DeepSpeed's spellings of each field of `model`: its name and its alias."""
    out = {}
    for name, f in model.model_fields.items():
        out[name] = name
        if f.alias:
            out[f.alias] = name
    return out


@pytest.mark.parametrize("ours, theirs, section", PAIRS, ids=[p[2] for p in PAIRS])
def test_every_deepspeed_key_is_declared_once_with_deepspeeds_default(ours, theirs, section):
    mine = keys_of(ours)
    # Each spelling belongs to one field only (keys_of would have kept the last).
    spellings = [n for f in dataclasses.fields(ours) if "key" in f.metadata
                 for n in (f.name, *f.metadata["key"].aliases)]
    assert len(spellings) == len(set(spellings))
    default = theirs()
    for spelling, field in ds_names(theirs).items():
        if theirs.model_fields[field].json_schema_extra and spelling != field:
            continue
        assert spelling in mine, f"DeepSpeed's '{section}.{spelling}' is not declared in zeroedu"
        ds = mine[spelling][1].ds
        if ds is not MISSING and field != "overlap_comm":   # overlap_comm: None, set by stage in a validator
            theirs_default = getattr(default, field)
            theirs_default = getattr(theirs_default, "value", theirs_default)   # enums
            assert ds == theirs_default, (section, spelling, ds, theirs_default)


def _accepts(fn) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


# Values DeepSpeed's pydantic models accept that zeroedu refuses, each for a reason its error gives.
STRICTER = {("zero_optimization", "allgather_bucket_size", 0): "its stages 1-2 divide by it",
            ("zero_optimization.offload_optimizer", "buffer_count", 0): "no buffer, nothing to swap through",
            ("zero_optimization.offload_param", "buffer_count", 0): "no buffer, nothing to swap through",
            ("fp16", "hysteresis", 0): "the scale would never fall", ("fp16", "hysteresis", -1): "the same"}


@pytest.mark.parametrize("ours, theirs, section", PAIRS, ids=[p[2] for p in PAIRS])
def test_integer_bounds_accept_and_refuse_what_deepspeed_does(ours, theirs, section):
    """Every integer key of DeepSpeed's section, at -1, 0 and 1: zeroedu accepts what DeepSpeed accepts (except the
    values listed in STRICTER) and refuses what DeepSpeed refuses, naming the key."""
    checked = 0
    for spelling, field in ds_names(theirs).items():
        info = theirs.model_fields[field]
        if info.annotation is not int or spelling != field and not info.alias:
            continue
        k = keys_of(ours).get(spelling)
        if k is None or k[1].refuse or k[1].only is not MISSING:
            continue
        for value in (-1, 0, 1):
            body = {spelling: value, **({"enabled": True} if section == "fp16" else {})}
            theirs_ok = _accepts(lambda b=body: theirs(**b))
            ours_ok = _accepts(lambda b=body: load_config(nest(section, b)))
            if (section, spelling, value) in STRICTER:
                assert theirs_ok and not ours_ok
                continue
            assert ours_ok == theirs_ok or (not ours_ok and spelling in ("stage",)), (section, spelling, value)
            if not ours_ok:
                assert f"{section}.{spelling}" in err(nest(section, body))
            checked += 1
    assert checked or section in ("bf16", "comms_logger")


def test_deepspeeds_aliases_and_switched_off_sections_are_accepted():
    """Each config below is accepted by DeepSpeed 0.19.8's classes (checked here), so zeroedu takes it too."""
    zero = {"stage": 3, "prefetch_bucket_size": 1000, "param_persistence_threshold": 10, "max_live_parameters": 5000,
            "max_reuse_distance": 0, "gather_16bit_weights_on_model_save": True, "sub_group_size": 0,
            "memory_efficient_linear": False, "stage3_model_persistence_threshold": 10**9}
    ds_zero.DeepSpeedZeroConfig(**zero)
    c = load_config({"zero_optimization": zero, "checkpoint": {"load_universal": False, "tag_validation": "Warn"},
                     "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
                     "comms_config": {"x": 1}, "monitor_config": {}, "cuda_visible_devices": "0,1"})
    z = c.zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.stage3_max_live_parameters,
            z.stage3_max_reuse_distance, z.stage3_gather_16bit_weights_on_model_save, z.sub_group_size) == \
        (1000, 10, 5000, 0, True, 0)
    notes = "\n".join(c.notes)
    for ignored in ("comms_config", "monitor_config", "cuda_visible_devices"):
        assert f"'{ignored}' is not a key DeepSpeed reads: ignored" in notes
    # Switched on, they ask for what zeroedu lacks: the error names the feature.
    m = err({"checkpoint": {"load_universal": True}, "compile": {"deepcompile": True},
             "tensor_parallel": {"autotp_size": 2}})
    assert "universal checkpoint" in m and "DeepCompile" in m and "tensor parallelism" in m
    # Both of DeepSpeed's names for one key: DeepSpeed refuses it too.
    with pytest.raises(Exception, match="Extra inputs"):
        ds_zero.DeepSpeedZeroConfig(prefetch_bucket_size=5, stage3_prefetch_bucket_size=6)
    assert "two names of one DeepSpeed key" in err({"zero_optimization": {"prefetch_bucket_size": 5,
                                                                          "stage3_prefetch_bucket_size": 6}})


def test_auto_in_deepspeeds_pydantic_sections_is_its_default():
    """DeepSpeedConfigModel.__init__ drops "auto" values (deepspeed/runtime/config_utils.py): the default."""
    raw = {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": "auto"}
    theirs = ds_zero.DeepSpeedZeroConfig(**raw)
    assert theirs.reduce_bucket_size == ds_zero.DeepSpeedZeroConfig().reduce_bucket_size
    c = load_config({"zero_optimization": raw, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert c.zero_optimization == load_config({"zero_optimization": {"stage": 2}}).zero_optimization
    assert c.precision == "fp32" and not ds_precision.DeepSpeedFP16Config(enabled="auto").enabled


@pytest.mark.parametrize("cfg, key, words", [
    ({"optimizer": {"type": ["Adam"]}}, "optimizer.type", "must be a string"),
    ({"optimizer": {"type": {"name": "Adam"}}}, "optimizer.type", "must be a string"),
    ({"scheduler": {"type": ["WarmupLR"]}}, "scheduler.type", "must be one of"),
    ({1: 2}, "1", "config keys are strings"),
    ({"zero_optimization": {"stage": 2, 3: True}}, "3", "config keys are strings"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 10**9}}},
     "zero_optimization.offload_param.buffer_count", "between 1 and 64"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e308}}}, "optimizer.params.lr", "at most"),
    ({"fp16": {"enabled": True, "loss_scale": 1e300}}, "fp16.loss_scale", "use 0 (dynamic)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e30}}}, "scheduler.params.warmup_max_lr",
     "at most"),
    ({"zeroedu": {"zeropp_weight_bits": 3}}, "zeroedu.zeropp_weight_bits", "must be 4 or 8"),
])
def test_bad_numbers_and_types_get_an_error_naming_the_key(cfg, key, words):
    m = err(cfg)
    assert key in m and words in m, m


def test_every_numeric_key_is_bounded():
    """Every int or float key declared anywhere has an upper bound or is a size (a cap that allocates nothing)."""
    from zeroedu.config.sections import OptimizerParams

    unbounded_sizes = {"reduce_bucket_size", "allgather_bucket_size", "sub_group_size", "stage3_prefetch_bucket_size",
                       "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                       "stage3_model_persistence_threshold", "zero_hpz_partition_size", "buffer_size", "max_in_cpu",
                       "loss_scale_window", "hysteresis", "number_checkpoints", "ledger_max_entries",
                       "ledger_max_steps", "timeline_keep", "train_batch_size", "train_micro_batch_size_per_gpu",
                       "gradient_accumulation_steps", "steps_per_print"}
    import zeroedu.config.top as top

    for cls in (ZeroConfig, OffloadConfig, OffloadParamConfig, FP16Config, OptimizerParams, ZeroeduConfig, top.Config):
        for f in dataclasses.fields(cls):
            k = f.metadata.get("key")
            bounds = getattr(k and k.check, "bounds", None)
            if bounds is None:
                continue
            assert bounds[0] is not None, f.name
            assert bounds[1] is not None or f.name in unbounded_sizes, f"{cls.__name__}.{f.name} has no upper bound"


def test_zeroedu_section_sets_module_knobs_and_resolves():
    from zeroedu import offload, zeropp

    before = (zeropp.GRAD_BITS, offload.CPU_ADAM)
    c = load_config({"zeroedu": {"zeropp_grad_bits": 8, "cpu_adam": "loop"}})
    try:
        c.zeroedu.apply()
        assert (zeropp.GRAD_BITS, offload.CPU_ADAM) == (8, "loop")
        resolved = c.resolved()["zeroedu"]
        assert resolved["zeropp_grad_bits"] == 8 and resolved["cpu_adam"] == "loop"
        assert resolved["timeline_keep"] > 0 and resolved["ledger_max_entries"] > 0
        json.dumps(c.resolved())
    finally:
        zeropp.GRAD_BITS, offload.CPU_ADAM = before
    # A key left out keeps the module's value.
    load_config({}).zeroedu.apply()
    assert (zeropp.GRAD_BITS, offload.CPU_ADAM) == before


def test_optimizer_fused_follows_deepspeed():
    """Left out: fused (DeepSpeed's FusedAdam); with torch_adam, DeepSpeed builds torch's Adam with its own default,
    which on CPU is not fused (checked on torch itself); given: as written."""
    import torch

    assert "fused" not in load_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}).optimizer.params
    c = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    torch_default = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).defaults["fused"]
    assert c.optimizer.params["fused"] is False and not torch_default
    c = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "fused": False}}})
    assert c.optimizer.params["fused"] is False
    assert "optimizer.params.fused" in err({"optimizer": {"type": "SGD", "params": {"fused": True}}})


def _save_with_knobs(rank: int, world: int, root: str) -> dict:
    import torch

    import zeroedu
    from zeroedu import zeropp

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
           "zeroedu": {"node_size": 2, "timeline_keep": 123}}
    engine, *_ = zeroedu.initialize(model=torch.nn.Linear(4, 2), config=cfg)
    path = engine.save_checkpoint(root)
    return {"node_size": zeropp.NODE_SIZE, "path": path}


def test_the_zeroedu_section_reaches_each_rank_and_the_checkpoint(tmp_path):
    import os

    import zeroedu

    results = zeroedu.launch(_save_with_knobs, world_size=2, args=(str(tmp_path),), timeout=120)
    assert [r["node_size"] for r in results] == [2, 2]
    path = results[0]["path"]
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert meta["config"]["zeroedu"]["node_size"] == 2 and meta["config"]["zeroedu"]["timeline_keep"] == 123
    assert meta["config"]["zero_optimization"]["stage"] == 1
    assert set(meta["config"]["zeroedu"]) == {f.name for f in dataclasses.fields(ZeroeduConfig)}
