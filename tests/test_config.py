"""Every config error path, with its message."""

from __future__ import annotations

import json

import pytest

from zeroedu.config import ConfigError, load_config


def err(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    return str(e.value)


def test_defaults_and_deepspeed_shape():
    c = load_config({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {
        "lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": True}})
    assert c.precision == "bf16" and c.stage == 2
    assert c.zero_optimization.reduce_bucket_size == 50_000_000
    assert c.optimizer.params["betas"] == (0.9, 0.95)
    assert load_config(None).precision == "fp32"


def test_file_path(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert load_config(str(p)).stage == 3
    assert "does not exist" in err(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{stage: 3")
    assert "not valid JSON" in err(str(tmp_path / "bad.json"))


def test_misspelt_keys_name_the_closest():
    # At the top level DeepSpeed ignores a key it does not read (deepspeed/runtime/config.py reads key by key), so
    # zeroedu accepts it too, with a note that names the closest key; inside a section it is an error, as DeepSpeed's
    # pydantic models (extra="forbid") make it.
    notes = "\n".join(load_config({"zero_optimisation": {}}).notes)
    assert "'zero_optimisation' is not a key DeepSpeed reads: ignored" in notes and "'zero_optimization'" in notes
    m = err({"zero_optimization": {"stage": 1, "reduce_bucket_sz": 10}})
    assert "zero_optimization.reduce_bucket_sz" in m and "zero_optimization.reduce_bucket_size" in m
    m = err({"fp16": {"enabled": True, "loss_scale_windw": 10}})
    assert "fp16.loss_scale_window" in m
    m = err({"optimizer": {"type": "Adam", "params": {"learning_rate": 1}}})
    assert "optimizer.params.learning_rate" in m


def test_real_deepspeed_keys_out_of_scope_are_refused_with_the_reason():
    for cfg, key, reason in [
            ({"pipeline": {"stages": 2}}, "pipeline", "pipeline parallelism"),
            ({"compression_training": {}}, "compression_training", "not part of ZeRO"),
            ({"zero_optimization": {"mics_shard_size": 2}}, "zero_optimization.mics_shard_size", "MiCS"),
            ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
             "fp16.fp16_master_weights_and_grads", "fp32 master weights"),
            ({"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}, "zero_optimization.zenflow", "ZenFlow")]:
        m = err(cfg)
        assert key in m and "real DeepSpeed setting" in m and "does not implement" in m and reason in m, m
    assert "1-bit" in err({"optimizer": {"type": "OneBitAdam"}})
    # A refused feature switched off asks for nothing; a key at DeepSpeed's default changes nothing.
    load_config({"flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False},
                 "prescale_gradients": False, "zero_optimization": {"ignore_unused_parameters": True}})
    assert "other than at its default true" in err({"zero_optimization": {"ignore_unused_parameters": False}})


def test_all_problems_in_one_error():
    m = err({"pipeline": {}, "train_batch_sise": 8, "fp16": {"enabled": "yes"}, "wandb": {"enabled": True},
             "zero_optimization": {"stage": 5, "overlap_com": True, "mics_shard_size": 4},
             "optimizer": {"type": "Adam", "params": {"lr": -1}}})
    assert m.startswith("7 problems in this config, each with its fix:"), m
    for part in ["'pipeline'", "'fp16.enabled' must be true",
                 "'wandb'", "'zero_optimization.stage' must be between 0 and 3",
                 "Did you mean 'zero_optimization.overlap_comm'", "'zero_optimization.mics_shard_size'",
                 "'optimizer.params.lr' must be >= 0"]:
        assert part in m, (part, m)


def test_auto_gets_the_trainer_explanation():
    m = err({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
             "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert m.startswith("2 problems")
    assert "'train_micro_batch_size_per_gpu' is \"auto\"" in m and "Hugging Face Trainer" in m
    assert "--per_device_train_batch_size" in m and "--learning_rate" in m
    # zero_optimization is a section DeepSpeed parses with pydantic, whose models drop "auto" (the default).
    c = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert c.zero_optimization.reduce_bucket_size is None
    assert any("'zero_optimization.reduce_bucket_size' is \"auto\": DeepSpeed reads it as the key left out" in n
               for n in c.notes)


def test_noted_keys_are_accepted_with_what_they_would_do():
    c = load_config({"aio": {"block_size": 1048576}, "zero_optimization": {
        "stage": 3, "round_robin_gradients": True, "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                                         "fast_init": False}}})
    notes = "\n".join(c.notes)
    assert "'aio' tunes libaio" in notes and "GPU machine" in notes
    assert "pin_memory' page-locks" in notes and "'fast_init'" in notes
    assert "round_robin" not in notes or "nothing to balance" in notes


def test_fp16_as_deepspeed_spells_it():
    c = load_config({"fp16": {"enabled": True, "loss_scale": 128, "consecutive_hysteresis": True}})
    assert not c.fp16.dynamic and c.fp16.loss_scale == 128.0 and c.fp16.consecutive_hysteresis
    assert load_config({"fp16": {"enabled": True, "loss_scale": 0}}).fp16.dynamic


def test_deepspeeds_adam_decouples_weight_decay():
    c = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}})
    assert c.optimizer.type == "AdamW" and any("adam_w_mode" in n for n in c.notes)
    c = load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1,
                                                              "adam_w_mode": False}}})
    assert c.optimizer.type == "Adam" and "adam_w_mode" not in c.optimizer.params


def test_types_and_ranges():
    assert "between 0 and 3" in err({"zero_optimization": {"stage": 4}})
    assert "must be an integer" in err({"zero_optimization": {"stage": "2"}})
    assert "must be true or false" in err({"zero_optimization": {"overlap_comm": "yes"}})
    assert "must be >= 1" in err({"gradient_accumulation_steps": 0})
    assert "must be a number" in err({"gradient_clipping": "1.0"})
    assert "betas" in err({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}})
    assert "must be one of Adam, AdamW, SGD" in err({"optimizer": {"type": "Adamm"}})
    assert "Did you mean 'Adam'" in err({"optimizer": {"type": "Adamm"}})
    assert "choose one precision" in err({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "must be a JSON object" in err({"fp16": True})
    assert "must be a dict or a path" in err(3)


def test_offload_and_zeropp_need_the_right_stage():
    assert "needs ZeRO stage 1, 2 or 3" in err({"zero_optimization": {"stage": 0, "offload_optimizer": {
        "device": "cpu"}}})
    assert "only at stage 3" in err({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "nvme_path" in err({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    assert "'none', 'cpu' or 'nvme'" in err({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "gpu"}}})
    assert "stage 3 only" in err({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})


def test_all_problems_at_once_across_activation_checkpointing_and_data_types():
    """activation_checkpointing and data_types report through the same collector as every other section."""
    m = err({"pipeline": {}, "activation_checkpointing": {"bogus": 1, "cpu_checkpointing": True, "profile": "no"},
             "data_types": {"grad_accum_dtype": "fp8", "extra": 1}, "zero_optimization": {"stage": 7}})
    assert m.startswith("7 problems in this config"), m
    for part in ["'pipeline'", "'zero_optimization.stage' must be between 0 and 3",
                 "unknown config key 'activation_checkpointing.bogus'",
                 "'activation_checkpointing.profile' must be true",
                 "'activation_checkpointing.cpu_checkpointing' acts on partitioned checkpoints",
                 "'data_types.grad_accum_dtype' must be 'fp32', 'bf16' or 'fp16'", "'data_types.extra'"]:
        assert part in m, (part, m)
    m = err({"activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
             "fp16": {"enabled": 1}})
    assert m.startswith("2 problems") and "needs 'activation_checkpointing.number_checkpoints'" in m, m
    c = load_config({"activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4},
                     "data_types": {"grad_accum_dtype": "fp32"}})
    assert c.activation_checkpointing.number_checkpoints == 4 and c.data_types.grad_accum_dtype == "fp32"
    assert load_config({"data_types": {"grad_accum_dtype": None}}).data_types.grad_accum_dtype is None


def test_contiguous_gradients_and_sub_group_size_say_when_they_change_nothing():
    for stage in (0, 1, 2, 3):
        notes = "\n".join(load_config({"zero_optimization": {"stage": stage, "contiguous_gradients": False}}).notes)
        assert f"'zero_optimization.contiguous_gradients' false changes nothing at stage {stage}" in notes, notes
    assert not load_config({"zero_optimization": {"stage": 2, "contiguous_gradients": True},
                            "gradient_clipping": 0.0}).notes
    c = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 1e6, "offload_optimizer": {"device": "cpu"}}})
    assert c.zero_optimization.sub_group_size == 1_000_000
    assert any("'zero_optimization.sub_group_size' is not applied with offload_optimizer" in n for n in c.notes)
    assert not load_config({"zero_optimization": {"stage": 2, "sub_group_size": 1e6}, "gradient_clipping": 1.0}).notes


def test_deprecated_spellings_deepspeed_still_maps():
    """deepspeed/runtime/zero/config.py (0.19.8) maps cpu_offload and cpu_offload_param to {"device": "cpu"} and
    refuses either next to its new key; runtime/precision_config.py reads "bfloat16" when "bf16" is absent."""
    c = load_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}})
    assert c.zero_optimization.offload_optimizer.device == c.zero_optimization.offload_param.device == "cpu"
    assert sum("deprecated in DeepSpeed" in n for n in c.notes) == 2
    c = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert c.zero_optimization.offload_optimizer.device == "none"
    m = err({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    assert "both given" in m and "deprecated spelling of 'offload_optimizer'" in m
    assert "only at stage 3" in err({"zero_optimization": {"stage": 2, "cpu_offload_param": True}})
    c = load_config({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}})
    assert any("cpu_offload_use_pin_memory" in n for n in c.notes)
    assert load_config({"bfloat16": {"enabled": True}}).precision == "bf16"
    c = load_config({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert c.precision == "fp32" and any("ignored, since 'bf16' is given" in n for n in c.notes)
    assert "bfloat16.enabled" in err({"bfloat16": {"enabled": "yes"}})
    assert "bfloat16.immediate_grad_update" in err({"bfloat16": {"enabled": True, "immediate_grad_update": True}})


def test_newer_deepspeed_keys_are_classified_not_typos():
    # noted: accepted with what they would do
    c = load_config({"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 1000,
                                           "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5}}})
    notes = "\n".join(c.notes)
    assert "caps the total elements kept whole" in notes and "CPUAdam" in notes
    # default-only: accepted at DeepSpeed's default, refused otherwise with the reason
    load_config({"dataloader_drop_last": False, "zero_optimization": {
        "stage": 3, "parameter_alignment": False, "stage3_use_all_reduce_for_fetch_params": False,
        "offload_optimizer": {"device": "cpu", "super_offload": False}, "zenflow": None}})
    for cfg, key in [({"dataloader_drop_last": True}, "dataloader_drop_last"),
                     ({"zero_optimization": {"parameter_alignment": True}}, "zero_optimization.parameter_alignment"),
                     ({"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True}},
                      "zero_optimization.stage3_use_all_reduce_for_fetch_params"),
                     ({"zero_optimization": {"stage": 3,
                                             "offload_optimizer": {"device": "cpu", "super_offload": True}}},
                      "zero_optimization.offload_optimizer.super_offload")]:
        m = err(cfg)
        assert f"'{key}' is a real DeepSpeed setting" in m and "other than at its default false" in m, m
    # refused, null or not
    assert "ZenFlow" in err({"zero_optimization": {"zenflow": {"offload": True}}})
    load_config({"zero_optimization": {"zenflow": None}})
    assert "unknown config key" not in err({"zero_optimization": {"zenflow": {}}, "dataloader_drop_last": 1})


def test_auto_anywhere_gets_the_trainer_explanation():
    m = err({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto", "params": {}},
             "prescale_gradients": "auto", "activation_checkpointing": {"partition_activations": "auto"},
             "zero_optimization": {"ignore_unused_parameters": "auto"}})
    assert m.startswith("4 problems"), m
    for where in ("optimizer.type", "scheduler.type", "prescale_gradients", "activation_checkpointing.partition_"
                  "activations"):
        assert f"'{where}' is \"auto\": a placeholder that the Hugging Face Trainer replaces" in m, (where, m)
    assert '"AdamW"' in m and '"WarmupDecayLR"' in m and "write the value yourself (the Trainer would write false" in m
    assert "must be one of" not in m and "unknown config key" not in m


def test_zero_config_has_each_field_once():
    import dataclasses

    from zeroedu.config import ZeroConfig

    names = [f.name for f in dataclasses.fields(ZeroConfig)]
    assert len(names) == len(set(names))
    assert names.count("stage3_gather_16bit_weights_on_model_save") == 1
    assert load_config({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}}
                       ).zero_optimization.stage3_gather_16bit_weights_on_model_save
