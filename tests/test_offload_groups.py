"""Parameter groups that differ in weight decay (the Hugging Face Trainer's "no decay on biases and norms") with
offload_optimizer: the host step, at "cpu" and at "nvme", decays each group by its own weight decay. Checked on 2
gloo ranks against a single-process torch AdamW built with the same groups, and against DeepSpeed 0.19.8 on 2 gloo
ranks with the same config (DeepSpeed's torch_adam: its CPUAdam is a C++ build). A client optimizer with a frozen
parameter, or over a subset of the model, with offload_optimizer: as DeepSpeed's."""

from __future__ import annotations

import importlib.util
import sys

import cloudpickle
import pytest
import torch

import zeroedu
from zeroedu.models import MLP, shard_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(600)

N, STEPS, LR, MICRO = 2, 3, 1e-2, 2
DECAY = 0.5   # large, so that a host step that ignored it would be far off


def _groups(model: torch.nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": DECAY},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _config(stage: int, tier: str, path: str) -> dict:
    offload = {"device": tier, "nvme_path": path, "buffer_count": 2} if tier == "nvme" else {"device": tier}
    # torch_adam: torch's AdamW as DeepSpeed builds it (the loop kernel on CPU), which the reference runs too.
    # A small bucket size: several master pieces, each holding parts of weights and biases.
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": offload}}


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(MICRO * world, 32, generator=gen), torch.randint(0, 10, (MICRO * world,), generator=gen)


def _train(rank: int, world: int, runs: list[tuple[str, int, str, str, str]]) -> dict:
    """For each (library, stage, tier, nvme folder, case): the mean loss of each step and the final full weights.
    case "groups": _groups as model_parameters; "frozen": a client AdamW over the model with one bias frozen;
    "subset": a client AdamW over the last layer only (the rest is not trained)."""
    import torch.nn.functional as F

    from zeroedu.graduate import import_deepspeed

    out = {}
    for name, stage, tier, path, case in runs:
        lib = import_deepspeed() if name == "deepspeed" else zeroedu
        cfg = _config(stage, tier, path)
        model = MLP(seed=0)
        if case == "groups":
            engine, *_ = lib.initialize(model=model, model_parameters=_groups(model), config=cfg)
        else:
            # DeepSpeed takes a torch optimizer with ZeRO-Offload only when told to (zero_force_ds_cpu_optimizer).
            cfg = {**{k: v for k, v in cfg.items() if k != "optimizer"}, "zero_force_ds_cpu_optimizer": False}
            if case == "frozen":
                model.layers[0].bias.requires_grad_(False)
            params = model.parameters() if case == "frozen" else model.layers[2].parameters()
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
            engine, *_ = lib.initialize(model=model, optimizer=opt, config=cfg)
        losses = []
        for s in range(STEPS):
            x, y = shard_batch(*_batch(s, world), rank, world, 0, 1)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().reshape(1).double()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
        weights = {}
        if name == "zeroedu":   # zeroedu's state_dict gathers at ZeRO-3
            weights = {k: v.float().clone() for k, v in engine.state_dict().items()}
            engine.close()
        elif stage < 3:   # DeepSpeed's ZeRO-3 module holds empty placeholders
            weights = {f"module.{k}": v.float().clone() for k, v in engine.module.state_dict().items()}
        out[(name, stage, tier) if case == "groups" else (name, stage, tier, case)] = {"losses": losses,
                                                                                       "weights": weights}
    return out


def _reference() -> dict:
    """One process, the whole batch, torch's AdamW over the same two groups."""
    model = MLP(seed=0)
    opt = torch.optim.AdamW(_groups(model), lr=LR, foreach=False)
    losses = []
    for s in range(STEPS):
        x, y = _batch(s, N)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "weights": {f"module.{k}": v.clone() for k, v in model.state_dict().items()}}


def _close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: Adam turns the rounding of a near-zero gradient element (the ranks' reduction adds in
    another order than one process) into a visible step of that element, so elementwise tolerances do not hold."""
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("nvme"))
    plan = [("zeroedu", stage, tier, path, "groups") for stage in (1, 2, 3) for tier in ("cpu", "nvme")]
    plan += [("zeroedu", stage, "cpu", path, case) for stage in (2, 3) for case in ("frozen", "subset")]
    if importlib.util.find_spec("deepspeed") is not None:
        plan += [("deepspeed", stage, "cpu", path, "groups") for stage in (1, 2, 3)]
        plan += [("deepspeed", stage, "cpu", path, case) for stage in (2, 3) for case in ("frozen", "subset")]
    return zeroedu.launch(_train, world_size=N, args=(plan,), timeout=550)[0]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grouped_weight_decay_with_offload_matches_one_process_adamw(runs, stage, tier):
    ref = _reference()
    ours = runs[("zeroedu", stage, tier)]
    assert _close(ours["losses"], ref["losses"]), (ours["losses"], ref["losses"])
    for k, v in ref["weights"].items():
        assert _rel(ours["weights"][k], v) < 1e-5, (k, _rel(ours["weights"][k], v))
    # The groups' decay is visible: weights decayed by 0.5 x lr a step differ from undecayed ones by far more
    # than the tolerance, and the biases (decay 0) are not shrunk toward zero.
    undecayed = MLP(seed=0)
    opt = torch.optim.AdamW(undecayed.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    for s in range(STEPS):
        x, y = _batch(s, N)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(undecayed(x), y).backward()
        opt.step()
    w = undecayed.state_dict()["layers.0.weight"]
    assert _rel(ours["weights"]["module.layers.0.weight"], w) > 1e-3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grouped_weight_decay_with_offload_trains_as_deepspeeds(runs, stage):
    if ("deepspeed", stage, "cpu") not in runs:
        pytest.skip("DeepSpeed is not installed")
    ours, theirs = runs[("zeroedu", stage, "cpu")], runs[("deepspeed", stage, "cpu")]
    assert _close(ours["losses"], theirs["losses"]), (ours["losses"], theirs["losses"])
    for k, v in theirs["weights"].items():
        assert _rel(ours["weights"][k], v) < 1e-5, (k, _rel(ours["weights"][k], v))


@pytest.mark.parametrize("case", ["frozen", "subset"])
@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_and_subset_client_optimizers_with_offload_train_as_deepspeeds(runs, stage, case):
    if ("deepspeed", stage, "cpu", case) not in runs:
        pytest.skip("DeepSpeed is not installed")
    ours, theirs = runs[("zeroedu", stage, "cpu", case)], runs[("deepspeed", stage, "cpu", case)]
    assert _close(ours["losses"], theirs["losses"]), (ours["losses"], theirs["losses"])
    for k, v in theirs["weights"].items():
        assert _rel(ours["weights"][k], v) < 1e-5, (k, _rel(ours["weights"][k], v))
    # What the optimizer does not hold keeps its initial value: the frozen bias, or the first layer.
    kept = "module.layers.0.bias" if case == "frozen" else "module.layers.0.weight"
    assert torch.equal(ours["weights"][kept], MLP(seed=0).state_dict()[kept.removeprefix("module.")])
