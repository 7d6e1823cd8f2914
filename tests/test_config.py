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
    assert "'zero_optimisation'" in (m := err({"zero_optimisation": {}})) and "'zero_optimization'" in m
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
            ({"zero_optimization": {"cpu_offload": True}}, "zero_optimization.cpu_offload", "offload_optimizer")]:
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
    assert m.startswith("8 problems in this config, each with its fix:"), m
    for part in ["'pipeline'", "'train_batch_sise'", "Did you mean 'train_batch_size'", "'fp16.enabled' must be true",
                 "'wandb'", "'zero_optimization.stage' must be between 0 and 3",
                 "Did you mean 'zero_optimization.overlap_comm'", "'zero_optimization.mics_shard_size'",
                 "'optimizer.params.lr' must be >= 0"]:
        assert part in m, (part, m)


def test_auto_gets_the_trainer_explanation():
    m = err({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
             "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert m.startswith("3 problems")
    assert "'train_micro_batch_size_per_gpu' is \"auto\"" in m and "Hugging Face Trainer" in m
    assert "--per_device_train_batch_size" in m and "--learning_rate" in m and "hidden_size x hidden_size" in m


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
