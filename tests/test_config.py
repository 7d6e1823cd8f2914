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


def test_real_deepspeed_keys_not_implemented():
    for cfg, key in [({"scheduler": {}}, "scheduler"),
                     ({"zero_optimization": {"sub_group_size": 1e9}}, "zero_optimization.sub_group_size"),
                     ({"flops_profiler": {}}, "flops_profiler"),
                     ({"fp16": {"loss_scale": 0}}, "fp16.loss_scale")]:
        m = err(cfg)
        assert key in m and "real DeepSpeed setting" in m and "does not implement" in m
    assert "DeepSpeed optimizer" in err({"optimizer": {"type": "OneBitAdam"}})


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
