"""Functions that run inside launched ranks for the graduation tests: the same script under zeroedu and DeepSpeed."""

from __future__ import annotations

import importlib
import time

import torch

from zeroedu.models import MLP, shard_batch


def quiet_deepspeed():
    """Import DeepSpeed for CPU ranks over gloo. Its shared-memory all-reduce op (a C++ extension compiled on first
    use, minutes here) serves only inference all-reduces, so it is not built (zeroedu.graduate does the same)."""
    from zeroedu.graduate import import_deepspeed

    return import_deepspeed()


def lr_trace(rank: int, world: int, runs: list[tuple[str, str, dict, int]]) -> dict:
    """For each (key, "zeroedu"|"deepspeed", config, steps): the batch sizes the engine derived and its lr after
    initialize and after every optimizer step; or the error initialize raised (type and message)."""
    out = {}
    for key, name, cfg, steps in runs:
        ds = quiet_deepspeed() if name == "deepspeed" else importlib.import_module("zeroedu")
        model = MLP(seed=0)
        t0 = time.time()
        try:
            engine, *_ = ds.initialize(model=model, config=cfg)
        except Exception as e:   # both libraries must refuse the same configs
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        lrs = [engine.get_lr()[0]]
        for s in range(steps):
            x = torch.randn(micro * accum * world, 32, generator=torch.Generator().manual_seed(s))
            y = torch.randint(0, 10, (micro * accum * world,), generator=torch.Generator().manual_seed(s))
            for m in range(accum):
                xs, ys = shard_batch(x, y, rank, world, m, accum)
                loss = torch.nn.functional.cross_entropy(engine(xs).float(), ys)
                engine.backward(loss)
                engine.step()
            lrs.append(engine.get_lr()[0])
        out[key + "/seconds"] = time.time() - t0
        out[key] = {"micro": micro, "accum": accum, "train_batch_size": engine.train_batch_size(), "lrs": lrs}
    return out


def zero_keys(rank: int, world: int) -> dict:
    """The ZeRO keys that change behaviour, each next to the run without it (tests/test_deepspeed_keys.py)."""
    import zeroedu

    from reference import make
    from workers import config, run_steps, train

    runs = {
        "s2": config(2, "bf16"), "s2-allreduce": config(2, "bf16", reduce_scatter=False),
        "s1": config(1, "bf16"), "s1-allreduce": config(1, "bf16", reduce_scatter=False),
        "s3": config(3, "bf16"), "s3-allreduce": config(3, "bf16", reduce_scatter=False),
        "s2-gather5000": config(2, "bf16", allgather_bucket_size=5000),
        "s1-gather100k": config(1, "fp32", allgather_bucket_size=100_000), "s1-fp32": config(1, "fp32"),
        "s2-noncontiguous": config(2, "bf16", contiguous_gradients=False),
        "s3-noncontiguous": config(3, "bf16", contiguous_gradients=False),
    }
    out = {key: train(rank, world, "gpt", cfg, steps=3, track_step=1) for key, cfg in runs.items()}
    ring = {**config(2, "bf16"), "comm_implementation": "ring"}
    for key, cfg in {"s2-count": config(2, "bf16"), "s2-count-ring": ring,
                     "s2-count5000": config(2, "bf16", allgather_bucket_size=5000),
                     "s1-count100k": config(1, "fp32", allgather_bucket_size=100_000)}.items():
        engine, *_ = zeroedu.initialize(model=make("gpt"), config=cfg)
        run_steps(engine, "gpt", rank, world, 2)
        out[key] = {"gathers": len(engine.ledger.select(op="all_gather", phase="step", step=1)),
                    "shard": engine.layout.shard_numel, "buckets": len(engine.layout.buckets)}
    for key, sub in {"s2-whole": None, "s2-sub4000": 4000}.items():
        out[key] = step_peak(rank, world, config(2, "bf16", **({"sub_group_size": sub} if sub else {})))
    return out


def step_peak(rank: int, world: int, cfg: dict) -> dict:
    """Peak bytes by category during the optimizer step alone (the second one), and the weights after it."""
    import zeroedu

    from reference import batch, loss_fn, make

    engine, *_ = zeroedu.initialize(model=make("gpt"), config=cfg)
    for s in range(2):
        x, y = batch("gpt", s, 8)
        xs, ys = shard_batch(x, y, rank, world)
        engine.backward(loss_fn(engine(xs), ys))
        if s == 1:
            with engine.track_memory():
                engine.step()
        else:
            engine.step()
    return {"peak": engine.memory()["peak"], "params": engine.master_state_dict(), "groups": engine.sub_groups(),
            "pieces": [p.numel() for p in engine.master_pieces]}


def client_objects(rank: int, world: int) -> dict:
    """initialize with a client optimizer and scheduler, next to the same run written in the config."""
    import zeroedu

    from reference import LR, make
    from workers import config, run_steps

    out = {}

    def train(key, cfg, steps=4, **client):
        model = client.pop("model", None) or make("gpt")
        engine, opt, _, sched = zeroedu.initialize(model=model, config=cfg, **client)
        lrs = []
        losses = []
        for s in range(steps):
            losses += run_steps(engine, "gpt", rank, world, 1, first=s)
            lrs.append(engine.get_lr()[0])
        out[key] = {"losses": losses, "params": engine.master_state_dict(), "lrs": lrs,
                    "optimizer": type(engine.optimizer).__name__, "defaults": {
                        k: engine.optimizer.defaults[k] for k in ("lr", "weight_decay", "betas")},
                    "sched": type(sched).__name__ if sched is not None else None}

    base = config(2)
    # torch_adam: the config that builds torch's AdamW as the client does (in DeepSpeed too; without it DeepSpeed
    # builds its FusedAdam, and zeroedu torch's fused kernel)
    adamw = {**base, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "betas": [0.8, 0.9],
                                                                "torch_adam": True}}}
    train("config-adamw", adamw)
    m = make("gpt")
    train("client-adamw", {k: v for k, v in base.items() if k != "optimizer"}, model=m,
          optimizer=torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, betas=(0.8, 0.9)))
    m = make("gpt")
    client = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, betas=(0.8, 0.9))
    train("client-steplr", base, model=m, optimizer=client,
          lr_scheduler=torch.optim.lr_scheduler.StepLR(client, step_size=2, gamma=0.5))
    m = make("gpt")
    train("callable-lambda", base, model=m, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1.0 / (step + 1)))
    m = make("gpt")
    train("config-warmup", {**base, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}, model=m)
    m = make("gpt")
    train("model-parameters", base, model=m, model_parameters=[{"params": list(m.parameters()), "lr": 2 * LR}])
    return out


def logging_keys(rank: int, world: int) -> dict:
    """The logging keys' lines, and the ledger and meter they were made from."""
    import zeroedu

    from reference import make
    from workers import config, run_steps

    cfg = {**config(2, "fp16"), "steps_per_print": 2, "wall_clock_breakdown": True, "memory_breakdown": True,
           "comms_logger": {"enabled": True, "verbose": True}}
    engine, *_ = zeroedu.initialize(model=make("gpt"), config=cfg)
    run_steps(engine, "gpt", rank, world, 4)
    summary = engine.log_summary()
    counts = {}
    for e in engine.ledger:
        counts[e.op] = counts.get(e.op, 0) + 1
    return {"lines": list(engine.log_lines), "summary": summary, "counts": counts,
            "per_step": [len([e for e in engine.ledger if e.step == s]) for s in range(4)],
            "resident": engine.memory()["resident"]}


def loss_scales(rank: int, world: int, pattern: list[bool], cases: list[tuple]) -> list[tuple[list, list]]:
    """The scale after each step under zeroedu's LossScaler and DeepSpeed's DynamicLossScaler, per case."""
    import zeroedu
    from zeroedu.precision import LossScaler

    quiet_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    out = []
    for consecutive, window, hysteresis in cases:
        theirs = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=window, min_scale=1.0, delayed_shift=hysteresis,
                                   consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        ours = LossScaler.from_config(zeroedu.load_config({"fp16": {
            "enabled": True, "loss_scale_window": window, "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive}}).fp16)
        a, b = [], []
        for overflow in pattern:
            theirs.update_scale(overflow)
            ours.update(overflow)
            a.append(ours.scale)
            b.append(theirs.cur_scale)
        out.append((a, b))
    return out


def corpus_train(rank: int, world: int, runs: dict[str, tuple[dict, float | None]]) -> dict:
    """Train each config 3 optimizer steps on an MLP, on batches of the size the config says."""
    import zeroedu

    out = {}
    for name, (cfg, client_lr) in runs.items():
        model = MLP(seed=0)
        client = torch.optim.Adam(model.parameters(), lr=client_lr) if client_lr else None
        engine, *_ = zeroedu.initialize(model=model, config=cfg, optimizer=client)
        micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
        losses, lrs = [], []
        for s in range(3):
            gen = torch.Generator().manual_seed(s)
            x, y = torch.randn(micro * accum * world, 32, generator=gen), torch.randint(0, 10, (micro * accum * world,),
                                                                                         generator=gen)
            total = torch.zeros(())
            for m in range(accum):
                xs, ys = shard_batch(x, y, rank, world, m, accum)
                dtype = next(engine.parameters()).dtype   # inputs in the model's dtype, as with DeepSpeed
                loss = torch.nn.functional.cross_entropy(engine(xs.to(dtype)).float(), ys)
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            torch.distributed.all_reduce(total)
            losses.append(float(total) / (world * accum))
            lrs.append(engine.get_lr()[0])
        out[name] = {"losses": losses, "lrs": lrs, "batch": [micro, accum, engine.train_batch_size()],
                     "lines": list(engine.log_lines)}
        close = getattr(engine, "close", None)
        if close:
            close()
    return out


def _offloads_optimizer(cfg: dict) -> bool:
    return cfg.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"


def corpus_both(rank: int, world: int, runs: dict[str, tuple[dict, float | None]]) -> dict:
    """corpus_train's 3 steps under zeroedu and under DeepSpeed 0.19.8: {(library, name): losses}."""
    out = {}
    for lib in ("zeroedu", "deepspeed"):
        ds = quiet_deepspeed() if lib == "deepspeed" else importlib.import_module("zeroedu")
        for name, (cfg, client_lr) in runs.items():
            model = MLP(seed=0)
            client = torch.optim.AdamW(model.parameters(), lr=client_lr) if client_lr else None
            if client and lib == "deepspeed" and _offloads_optimizer(cfg):
                # DeepSpeed refuses a torch optimizer with ZeRO-Offload (zero_force_ds_cpu_optimizer): a script for
                # it passes DeepSpeedCPUAdam, here with torch AdamW's defaults (weight decay 0.01, decoupled).
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                client = DeepSpeedCPUAdam(model.parameters(), lr=client_lr, weight_decay=0.01, adamw_mode=True)
            engine, *_ = ds.initialize(model=model, config=cfg, optimizer=client,
                                       model_parameters=None if client else model.parameters())
            micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
            losses = []
            for s in range(3):
                gen = torch.Generator().manual_seed(s)
                x = torch.randn(micro * accum * world, 32, generator=gen)
                y = torch.randint(0, 10, (micro * accum * world,), generator=gen)
                total = torch.zeros((), dtype=torch.float64)
                for m in range(accum):
                    xs, ys = shard_batch(x, y, rank, world, m, accum)
                    dtype = next(engine.module.parameters()).dtype
                    loss = torch.nn.functional.cross_entropy(engine(xs.to(dtype)).float(), ys)
                    engine.backward(loss)
                    engine.step()
                    total += float(loss.detach())
                torch.distributed.all_reduce(total)
                losses.append(float(total) / (world * accum))
            out[(lib, name)] = losses
            del engine
    return out
