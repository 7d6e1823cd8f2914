"""Functions that run inside launched ranks for tests/test_engine_facade.py: one script, run under zeroedu and
under DeepSpeed 0.19.8, calling what training scripts call on DeepSpeed's engine."""

from __future__ import annotations

import importlib

import torch

from zeroedu.models import MLP, shard_batch

LR = 1e-2


def _lib(name: str):
    if name == "deepspeed":
        from graduation_workers import quiet_deepspeed

        return quiet_deepspeed()
    return importlib.import_module("zeroedu")


def _config(stage: int, accum: int = 1) -> dict:
    # torch_adam: DeepSpeed steps torch's AdamW (not its FusedAdam, a C++ build); zeroedu then does too.
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _batch(step: int, rank: int, world: int, micro: int = 2):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(micro * world, 32, generator=gen), torch.randint(0, 10, (micro * world,), generator=gen)
    return shard_batch(x, y, rank, world, 0, 1)


def _loss(engine, step: int, rank: int, world: int) -> torch.Tensor:
    x, y = _batch(step, rank, world)
    return torch.nn.functional.cross_entropy(engine(x).float(), y)


def _mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / torch.distributed.get_world_size()


def surface(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    """For each library and stage: what the facade calls return during an HF-style loop of 3 steps."""
    out = {}
    for name in ("zeroedu", "deepspeed"):
        lib = _lib(name)
        for stage in stages:
            model = MLP(seed=0)
            engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
            r: dict = {"names": [n for n, _ in engine.named_parameters()],
                       "count": len(list(engine.parameters())), "stage": engine.zero_optimization_stage(),
                       "module_is_model": engine.module is model}
            engine.eval()
            r["eval_mode"] = engine.module.training
            engine.train()
            r["train_mode"] = engine.module.training
            losses, norms = [], []
            for s in range(3):
                engine.zero_grad()
                loss = _loss(engine, s, rank, world)
                engine.backward(loss)
                engine.step()
                losses.append(_mean(float(loss.detach())))
                norms.append(engine.get_global_grad_norm())
            engine.zero_grad()
            r["grads_clear"] = all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
            r["losses"], r["global_steps"] = losses, engine.global_steps
            r["norms"] = [None if n is None else float(n) for n in norms]
            sd = engine.state_dict()
            r["state_keys"] = sorted(sd)
            if stage < 3 or name == "zeroedu":   # DeepSpeed's stage-3 state_dict holds empty placeholders
                r["state"] = {k: v.detach().float().clone() for k, v in sd.items()}
            try:
                with engine.no_sync():
                    pass
                r["no_sync"] = "ok"
            except Exception as e:
                r["no_sync"] = type(e).__name__
            out[(name, stage)] = r
            del engine
    return out


def no_sync_training(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    """Two backwards per step, the first inside no_sync(): the step sees the sum of both, reduced once."""
    out = {}
    for name in ("zeroedu", "deepspeed"):
        lib = _lib(name)
        for stage in stages:
            model = MLP(seed=0)
            engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
            losses = []
            for s in range(3):
                with engine.no_sync():
                    engine.backward(_loss(engine, 10 + s, rank, world))
                loss = _loss(engine, s, rank, world)
                engine.backward(loss)
                engine.step()
                losses.append(_mean(float(loss.detach())))
            out[(name, stage)] = losses
    return out


def partial_optimizers(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    """A frozen parameter inside a client optimizer, a client optimizer over a subset of the model, and parameter
    groups that differ in weight decay (with the config's AdamW)."""
    out = {}
    for name in ("zeroedu", "deepspeed"):
        lib = _lib(name)
        for stage in stages:
            for case in ("frozen", "subset", "groups"):
                model = MLP(seed=0)
                cfg = {k: v for k, v in _config(stage).items() if k != "optimizer"}
                if case == "groups":   # the Trainer's groups: weight decay on weights, none on biases
                    named = list(model.named_parameters())
                    groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.5},
                              {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
                    engine, *_ = lib.initialize(model=model, model_parameters=groups, config=_config(stage))
                elif case == "frozen":
                    model.layers[0].bias.requires_grad_(False)
                    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
                    engine, *_ = lib.initialize(model=model, optimizer=opt, config=cfg)
                else:
                    opt = torch.optim.AdamW(model.layers[2].parameters(), lr=LR, weight_decay=0.0)
                    # DeepSpeed's stage 0 clips by the norm of every parameter's gradient, the ones its optimizer
                    # does not hold included (clip_fp32_gradients over module.parameters()); zeroedu's norm, like
                    # DeepSpeed's stages 1-3, covers the trained ones. Without clipping the runs compare exactly.
                    cfg["gradient_clipping"] = 0.0
                    engine, *_ = lib.initialize(model=model, optimizer=opt, config=cfg)
                losses = []
                for s in range(3):
                    loss = _loss(engine, s, rank, world)
                    engine.backward(loss)
                    engine.step()
                    losses.append(_mean(float(loss.detach())))
                state = engine.state_dict() if stage < 3 or name == "zeroedu" else {}
                out[(name, stage, case)] = {"losses": losses, "first_weight": state.get(
                    "module.layers.0.weight", torch.zeros(())).float().clone()}
    return out


def load_weights(rank: int, world: int, stages: tuple[int, ...]) -> dict:
    """zeroedu only: load another model's weights with engine.load_state_dict, then train; next to an engine
    built on that model directly (the reference)."""
    import zeroedu

    out = {}
    for stage in stages:
        runs = {}
        for how in ("loaded", "direct"):
            model = MLP(seed=1 if how == "direct" else 0)
            engine, *_ = zeroedu.initialize(model=model, config=_config(stage))
            if how == "loaded":
                engine.load_state_dict({f"module.{k}": v for k, v in MLP(seed=1).state_dict().items()})
            losses = []
            for s in range(3):
                loss = _loss(engine, s, rank, world)
                engine.backward(loss)
                engine.step()
                losses.append(_mean(float(loss.detach())))
            runs[how] = {"losses": losses, "weights": engine.master_state_dict()}
        out[stage] = runs
    return out
