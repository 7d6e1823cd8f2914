"""Non-finite numbers in a config are refused wherever they appear, with the key's path in the message."""

import json
import math
import sys

import cloudpickle
import pytest
import torch

import zeroedu
from zeroedu.config import ConfigError, load_config

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the ranks need not import this test module

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}}


def with_value(path: str, value) -> dict:
    cfg = json.loads(json.dumps(BASE))
    *parents, last = path.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


@pytest.mark.parametrize("path, value", [
    ("optimizer.params.lr", math.inf),                    # trained into NaN losses, silently
    ("optimizer.params.lr", -math.inf),
    ("optimizer.params.weight_decay", math.nan),
    ("optimizer.params.betas", [0.9, math.nan]),
    ("gradient_clipping", math.nan),                      # turned clipping off, silently
    ("gradient_clipping", math.inf),
    ("fp16.min_loss_scale", math.inf),
    ("zero_optimization.reduce_bucket_size", math.inf),
])
def test_non_finite_numbers_are_refused(path, value):
    cfg = with_value(path, value)
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    where = path + ("[1]" if isinstance(value, list) else "")
    assert f"'{where}' must be a finite number" in str(err.value), str(err.value)


def test_nan_and_infinity_in_a_json_file(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": NaN,'
                 ' "optimizer": {"type": "Adam", "params": {"lr": Infinity}}}')
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_config(str(f))
    assert load_config(with_value("gradient_clipping", 1.0)).gradient_clipping == 1.0   # finite ones pass


def _init_with_inf_lr(rank, world_size):
    zeroedu.initialize(model=torch.nn.Linear(4, 4), config=with_value("optimizer.params.lr", math.inf))


@pytest.mark.timeout(60)
def test_a_rank_initializing_with_lr_inf_fails_with_the_key():
    with pytest.raises(zeroedu.launch.RankError, match=r"ConfigError: 'optimizer.params.lr' must be a finite"):
        zeroedu.launch(_init_with_inf_lr, world_size=2)


@pytest.mark.parametrize("make, where", [
    (lambda ps: torch.optim.Adam(ps, lr=math.inf), "optimizer= (Adam) has lr=inf"),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=math.inf), "optimizer= (AdamW) has eps=inf"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=math.nan), "optimizer= (SGD) has momentum=nan"),
])
def test_a_client_optimizer_with_a_non_finite_hyperparameter_is_refused(make, where):
    """A torch optimizer passed to initialize is read like the config's section, and refused like it."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as err:
        zeroedu.initialize(model=model, optimizer=make(model.parameters()), config=BASE)
    assert where in str(err.value) and "must be finite" in str(err.value), str(err.value)


def test_model_parameters_with_a_non_finite_lr_are_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"model_parameters has lr=inf: hyperparameters must be finite"):
        zeroedu.initialize(model=model, model_parameters=[{"params": list(model.parameters()), "lr": math.inf}],
                           config=BASE)


def test_dist_init_required_false_without_torch_distributed_is_refused():
    """DeepSpeed's dist_init_required=False: the caller has initialized torch.distributed; here it has not."""
    import torch.distributed as dist

    assert not dist.is_initialized()   # conftest leaves no process group between modules
    with pytest.raises(RuntimeError, match=r"\(dist_init_required=False\) needs torch.distributed"):
        zeroedu.initialize(model=torch.nn.Linear(4, 4), config=BASE, dist_init_required=False)
    assert not dist.is_initialized()
