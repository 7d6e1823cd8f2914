"""Checkpoints: exact resume, resharding across every stage and world size, consolidation, bad files, crashes.

Real ranks over real gloo, real files. References are independent of zeroedu.checkpoint: an uninterrupted run
in other processes (bitwise), a single-process torch run on the global batch (tests/reference.py), and the
engine's state gathered here with torch.distributed directly. Starting ranks is the slow part on two cores, so
each world size saves all its checkpoints in one launch and each target world size loads all of them in one
(mixed precision, the bad checkpoints and the large one for the memory test ride along); only the two crashes
need launches of their own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zeroedu
from zeroedu import checkpoint
from zeroedu.checkpoint import CheckpointError
from zeroedu.models import TinyGPT, TinyGPTConfig, shard_batch

from reference import LR, batch, loss_fn, make, param_rel, rel, single_process
from workers import run_steps

pytestmark = pytest.mark.timeout(900)   # the fixtures' launches count toward the first test

STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 4)
K, M = 2, 2                      # steps before the save, steps after it
CPU, NVME = {"device": "cpu"}, {"device": "nvme", "nvme_path": "{root}"}   # {root}: the test's folder
VARIANTS = {                     # extra exact-resume settings: name -> (model, world size, stages, overrides)
    "accum": ("gpt", 2, (0, 2), {"accum": 2}),
    "persist": ("gpt", 2, (3,), {"persist": 200}),
    "zeropp": ("quirky", 4, (3,), {"zero": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                                            "zero_quantized_gradients": True}}),
    # offload at every stage that has it, on both tiers, and the parameters too (stage 3 only)
    "offload-cpu": ("quirky", 2, (1, 2, 3), {"zero": {"offload_optimizer": CPU}}),
    "offload-nvme": ("quirky", 2, (1, 2, 3), {"zero": {"offload_optimizer": NVME}}),
    "offload-param-cpu": ("quirky", 2, (3,), {"zero": {"offload_optimizer": CPU, "offload_param": CPU}}),
    "offload-param-nvme": ("quirky", 2, (3,), {"zero": {"offload_optimizer": NVME, "offload_param": NVME}}),
    # 16-bit compute, fp32 masters; fp16 with a loss scale that doubles every step
    "bf16": ("gpt", 2, STAGES, {"precision": "bf16"}),
    "fp16": ("gpt", 2, (1, 3), {"precision": "fp16"}),
}
NVME_STAGE3 = VARIANTS["offload-nvme"][3]


# -- inside the ranks ---------------------------------------------------------------------------------------

def cfg(stage: int, world: int, precision: str = "fp32", accum: int = 1, persist: int = 0,
        optimizer: str = "Adam", zero: dict | None = None) -> dict:
    c = {"train_micro_batch_size_per_gpu": 8 // (world * accum), "gradient_accumulation_steps": accum,
         "optimizer": {"type": optimizer, "params": {"lr": LR}},
         "bf16": {"enabled": precision == "bf16"},
         "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8, "loss_scale_window": 1},
         "zero_optimization": {"stage": stage, "reduce_bucket_size": 60,
                               "stage3_param_persistence_threshold": persist, **(zero or {})}}
    return c


def train(engine, model: str, rank: int, world: int, steps: int) -> list[float]:
    """`steps` more steps, on the batches that follow the engine's step counter (so a resumed run continues)."""
    return run_steps(engine, model, rank, world, steps, first=engine.global_step)


def full_state(engine) -> dict:
    """Weights and optimizer state of the whole model by parameter name, gathered with torch.distributed.
    (Offload keeps the optimizer state on the host or in files; its engine says where with a method.)"""
    out = {"params": engine.master_state_dict(), "step": None}
    if hasattr(engine, "checkpoint_optimizer_state"):
        states = engine.checkpoint_optimizer_state()
    else:
        states = [engine.optimizer.state.get(p, {}) for p in engine.master_pieces]
    first = states[0]
    if "step" in first:
        out["step"] = float(first["step"])
    names = [engine.names[p] for p in engine.layout.params]
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in first:
            continue
        full = torch.zeros(engine.layout.full_numel)
        for b, state in zip(engine.layout.buckets, states, strict=True):
            t = state[key].float()
            view = full[b.start: b.start + b.padded]
            if t.numel() == b.padded:
                view.copy_(t)
            else:
                dist.all_gather(list(view.chunk(engine.world_size)), t.contiguous())
        out[key] = dict(zip(names, (v.clone() for v in engine.layout.param_views(full)), strict=True))
    return out


def draws() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def save_all(rank: int, world: int, root: str, runs: list[tuple], big: str | None = None) -> dict:
    """For each run: an uninterrupted K+M-step run, and a K-step run that saves (the one resumed later).
    `big`: also save the large checkpoint that the consolidation memory test reads, there."""
    out = {}
    for key, model, stage, over in runs:
        over = json.loads(json.dumps(over).replace("{root}", root))   # the NVMe folder is under root
        engine, *_ = zeroedu.initialize(model=make(model), config=cfg(stage, world, **over))
        losses = train(engine, model, rank, world, K + M)
        straight = {"losses": losses, "params": engine.master_state_dict()}
        engine, *_ = zeroedu.initialize(model=make(model), config=cfg(stage, world, **over))
        train(engine, model, rank, world, K)
        for seed in (torch.manual_seed, random.seed, np.random.seed):
            seed(100 + rank)    # a different RNG position on every rank
        draws()
        client = {"epoch": 7, "rank": rank, "order": torch.arange(5) + rank}
        path = engine.save_checkpoint(os.path.join(root, key), client_state=client)
        out[key] = {"straight": straight, "saved": full_state(engine), "draws": draws(), "path": path}
    if big:
        out["big"] = make_big_checkpoint(rank, world, big)
    return out


def load_all(rank: int, world: int, root: str, jobs: list[tuple], bad: tuple | None = None) -> dict:
    """For each job: an engine at the target setting loads a checkpoint and trains M more steps. One engine
    per setting serves every job (each load must replace everything the previous job left in it).
    `bad`: (cases, good checkpoint) for try_bad_loads, run first."""
    out, engines = {}, {}
    if bad:
        out["bad"] = try_bad_loads(rank, world, *bad)
    for job, src, model, stage, over in jobs:
        over = json.loads(json.dumps(over).replace("{root}", root))
        setting = (model, stage, repr(sorted(over.items())))
        if setting not in engines:
            engines[setting] = zeroedu.initialize(model=make(model), config=cfg(stage, world, **over))[0]
        engine = engines[setting]
        path, client = engine.load_checkpoint(os.path.join(root, src))
        r = {"draws": draws(), "client": client, "loaded": full_state(engine),
             "counters": (engine.global_step, engine.micro_step)}
        r["losses"] = train(engine, model, rank, world, M)
        r["params"] = engine.master_state_dict()
        out[job] = r
    return out


def key(model: str, stage: int, world: int, variant: str = "fp32") -> str:
    return f"{model}-s{stage}-n{world}-{variant}"


def save_runs(world: int) -> list[tuple]:
    runs = [(key(m, s, world), m, s, {}) for m in ("gpt", "quirky") for s in STAGES]
    runs += [(key(m, s, w, v), m, s, over) for v, (m, w, stages, over) in VARIANTS.items() if w == world
             for s in stages]
    if world == 4:   # a bf16 checkpoint to reshard (stage 1, N 4 -> stage 3, N 2)
        runs += [(key("gpt", 1, 4, "bf16-n4"), "gpt", 1, {"precision": "bf16"})]
    return runs


def load_jobs(world: int) -> list[tuple]:
    jobs = [(("gpt", s, world), key("gpt", s, world), "gpt", s, {}) for s in STAGES]
    jobs += [(("quirky", s, n, s2), key("quirky", s, n), "quirky", s2, {})
             for s in STAGES for n in WORLDS for s2 in STAGES]
    jobs += [((v, s), key(m, s, w, v), m, s, over) for v, (m, w, stages, over) in VARIANTS.items() if w == world
             for s in stages]
    if world == 2:   # ZeRO++ (hpZ over nodes of 2, quantized weights and gradients) into plain stage 1
        jobs += [(("zeropp", "to stage 1"), key("quirky", 3, 4, "zeropp"), "quirky", 1, {})]
        jobs += [(("plain", "to offload-nvme"), key("quirky", 2, 4), "quirky", 3, NVME_STAGE3)]
        jobs += [(("bf16", "to stage 3, N2"), key("gpt", 1, 4, "bf16-n4"), "gpt", 3, {"precision": "bf16"})]
    if world == 1:
        jobs += [(("offload-nvme", "to plain"), key("quirky", 3, 2, "offload-nvme"), "quirky", 0, {})]
    return jobs


# -- fixtures -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    results = {n: zeroedu.launch(save_all, world_size=n, args=(root, save_runs(n)),
                                 kwargs={"big": os.path.join(root, "big") if n == 4 else None}, timeout=400)
               for n in WORLDS}
    return root, results


@pytest.fixture(scope="module")
def bad_dirs(saved, tmp_path_factory):
    """A copy of a good checkpoint (gpt, stage 2, N 2) broken in each way of BAD."""
    root, _ = saved
    good = os.path.join(root, key("gpt", 2, 2))
    other = os.path.join(root, key("quirky", 2, 2))
    bad = tmp_path_factory.mktemp("bad")
    return good, {how: corrupt(good, str(bad / how.replace(" ", "-")), how, other) for how in BAD}


@pytest.fixture(scope="module")
def loaded(saved, bad_dirs):
    root, _ = saved
    good, dirs = bad_dirs
    cases = [(how, d, None) for how, d in dirs.items()] + [("missing tag", good, "nope")]
    return {n: zeroedu.launch(load_all, world_size=n, args=(root, load_jobs(n)),
                              kwargs={"bad": (cases, good) if n == 2 else None}, timeout=400) for n in WORLDS}


def check_exact(saved: dict, loaded: dict, cases: list[tuple], world: int) -> None:
    for job, src in cases:
        for rank in range(world):
            straight, resumed = saved[rank][src]["straight"], loaded[rank][job]
            assert resumed["losses"] == straight["losses"][K:], (job, rank)
            assert_same(resumed["params"], straight["params"], f"{job} rank {rank}")
            assert resumed["draws"] == saved[rank][src]["draws"], f"{job}: RNG not restored"
            c = resumed["client"]
            assert (c["epoch"], c["rank"], c["order"].tolist()) == (7, rank, [rank + i for i in range(5)])
            accum = 2 if job[0] == "accum" else 1
            assert resumed["counters"] == (K, K * accum)


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


# -- exact resume ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS, ids=lambda n: f"N{n}")
def test_exact_resume_every_stage(saved, loaded, world):
    """Save after K steps, resume in fresh processes for M: bit for bit the K+M-step run without a stop."""
    _, results = saved
    cases = [(("gpt", s, world), key("gpt", s, world)) for s in STAGES]
    cases += [(("quirky", s, world, s), key("quirky", s, world)) for s in STAGES]
    cases += [((v, s), key(m, s, w, v)) for v, (m, w, stages, _) in VARIANTS.items() if w == world for s in stages]
    check_exact(results[world], loaded[world], cases, world)


def test_mixed_precision_checkpoints_hold_fp32_masters_and_the_scaler(saved):
    """bf16 and fp16 resume exactly (test_exact_resume_every_stage[N2]); on disk: fp32 masters, the fp16 scale."""
    root, results = saved
    src = results[2][0][key("gpt", 2, 2, "bf16")]["saved"]["params"]
    sd = checkpoint.consolidate(os.path.join(root, key("gpt", 2, 2, "bf16")))
    assert sd["wte.weight"].dtype == torch.float32
    assert_same({k: sd[k] for k in src}, src, "bf16 consolidated")
    # loss_scale_window 1: as in DeepSpeed 0.19.8's DynamicLossScaler, the scale doubles from the second clean
    # step on (a window of clean steps before it), so K clean steps double it K - 1 times.
    assert checkpoint.read_metadata(os.path.join(root, key("gpt", 3, 2, "fp16"), f"global_step{K}"))[
        "loss_scaler"]["scale"] == 2.0 ** (8 + K - 1)


# -- resharding: every (S, N) -> (S', N') ---------------------------------------------------------------------

@pytest.mark.parametrize("target", WORLDS, ids=lambda n: f"to-N{n}")
def test_reshard_every_pair(saved, loaded, target):
    """48 sources/targets per target world size: the loaded state equals the saved state bit for bit
    (weights, Adam moments, step), and training continues on the single-process run's curve."""
    _, results = saved
    ref_losses, ref_params = single_process("quirky", steps=K + M)
    for s in STAGES:
        for n in WORLDS:
            src = results[n][0][key("quirky", s, n)]["saved"]
            for s2 in STAGES:
                for rank in range(target):
                    r = loaded[target][rank][("quirky", s, n, s2)]
                    what = f"(stage {s}, N {n}) -> (stage {s2}, N {target}) rank {rank}"
                    got = r["loaded"]
                    assert got["step"] == src["step"] == K, what
                    for part in ("params", "exp_avg", "exp_avg_sq"):
                        assert_same(got[part], src[part], f"{what} {part}")
                    assert rel(r["losses"], ref_losses[K:]) < 1e-6, (what, r["losses"], ref_losses[K:])
                    assert param_rel(r["params"], ref_params) < 1e-6, what
                    c = r["client"]
                    assert c["rank"] == (rank if rank < n else 0), what


@pytest.mark.parametrize("source,job,target", [
    (("quirky", 3, 4, "zeropp"), ("zeropp", "to stage 1"), 2),            # ZeRO++ keeps stage 3's master pieces
    (("quirky", 2, 4, "fp32"), ("plain", "to offload-nvme"), 2),          # into master and Adam files on "NVMe"
    (("quirky", 3, 2, "offload-nvme"), ("offload-nvme", "to plain"), 1),  # and back out of them
    (("gpt", 1, 4, "bf16-n4"), ("bf16", "to stage 3, N2"), 2),            # fp32 masters under bf16 compute
], ids=["zeropp->stage1", "stage2->stage3+nvme", "stage3+nvme->stage0", "bf16-stage1-N4->stage3-N2"])
def test_reshard_with_zeropp_offload_and_bf16(saved, loaded, source, job, target):
    _, results = saved
    src = results[source[2]][0][key(*source)]
    for rank in range(target):
        r = loaded[target][rank][job]
        for part in ("params", "exp_avg", "exp_avg_sq"):
            assert_same(r["loaded"][part], src["saved"][part], f"{job}, rank {rank}, {part}")
        assert r["loaded"]["step"] == K
        if job[0] == "bf16":   # bf16 sums in another order at another N: the same curve to bf16's precision
            assert rel(r["losses"], src["straight"]["losses"][K:]) < 1e-2, (r["losses"], src["straight"])
        elif job[0] != "zeropp":   # ZeRO++ quantizes weights and gradients: not the full-precision curve
            ref_losses, _ = single_process("quirky", steps=K + M)
            assert rel(r["losses"], ref_losses[K:]) < 1e-6, (job, r["losses"], ref_losses[K:])


# -- consolidation --------------------------------------------------------------------------------------------

def test_consolidate_equals_single_process_and_loads_into_plain_torch(saved):
    root, results = saved
    _, ref_params = single_process("gpt", steps=K)
    for s in STAGES:
        for n in WORLDS:
            d = os.path.join(root, key("gpt", s, n))
            sd = checkpoint.consolidate(d)
            assert_same({k: sd[k] for k in ref_params}, results[n][0][key("gpt", s, n)]["saved"]["params"], d)
            assert param_rel({k: sd[k] for k in ref_params}, ref_params) < 1e-6, d
            model = TinyGPT(seed=5)
            model.load_state_dict(sd)                    # strict: every key, tied names and buffers
            assert model.head.weight is model.wte.weight and torch.equal(model.wte.weight.detach(), sd["wte.weight"])
            assert list(sd) == list(TinyGPT().state_dict())
            assert all(v.dtype == torch.float32 for k, v in sd.items() if "mask" not in k)


def test_cli_consolidate(saved, tmp_path, capsys):
    from zeroedu import cli

    root, results = saved
    out = str(tmp_path / "model.pt")
    assert cli.main(["consolidate", os.path.join(root, key("gpt", 3, 4)), out]) == 0
    assert "wrote" in capsys.readouterr().out
    sd = torch.load(out, weights_only=True)
    assert_same({k: sd[k] for k in results[4][0][key("gpt", 3, 4)]["saved"]["params"]},
                results[4][0][key("gpt", 3, 4)]["saved"]["params"], "cli")
    assert checkpoint.main([str(tmp_path / "nothing"), out]) == 1
    assert "does not exist" in capsys.readouterr().err


def make_big_checkpoint(rank: int, world: int, d: str) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))   # 4.2 M parameters
    engine, *_ = zeroedu.initialize(model=model, config=cfg(1, world))
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    engine.step()
    engine.save_checkpoint(d, "big")
    return engine.layout.numel


MEASURE = """
import sys, torch
from zeroedu import checkpoint
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
torch.save(torch.zeros(4), sys.argv[2])
torch.load(sys.argv[2], weights_only=True, mmap=True)   # torch.load's one-time allocations, before measuring
before = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")   # reset the peak (VmHWM) to the current size
sd = checkpoint.consolidate(sys.argv[1], "big")
print(rss("VmHWM:") - before, sum(v.numel() for v in sd.values()))
"""


def test_consolidate_memory_is_model_plus_one_shard(saved, tmp_path):
    """Peak host memory of consolidate: at most the fp32 model plus one shard (here 4 shards of master+Adam)."""
    root, results = saved
    d = os.path.join(root, "big")
    numel = results[4][0]["big"]
    proc = subprocess.run([sys.executable, "-c", MEASURE, d, str(tmp_path / "warm.pt")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    grew, n = map(int, proc.stdout.split())
    model, shard = 4 * numel, os.path.getsize(os.path.join(d, "big", "rank0.pt"))
    total = sum(os.path.getsize(os.path.join(d, "big", f"rank{r}.pt")) for r in range(4))
    assert n == numel
    assert grew < model + shard, (grew, model, shard, total)
    assert total > shard + 8 * 2**20     # the bound is tight enough to catch reading every shard at once


# -- bad checkpoints ------------------------------------------------------------------------------------------

def snapshot(engine) -> dict:
    return {"state": full_state(engine), "counters": (engine.global_step, engine.micro_step),
            "rng": torch.get_rng_state()}


def same_snapshot(a: dict, b: dict) -> bool:
    if a["counters"] != b["counters"] or not torch.equal(a["rng"], b["rng"]) or \
            a["state"]["step"] != b["state"]["step"]:
        return False
    parts = [(a["state"].get(p, {}), b["state"].get(p, {})) for p in ("params", "exp_avg", "exp_avg_sq")]
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in parts)


def try_bad_loads(rank: int, world: int, cases: list[tuple], good: str) -> dict:
    """Each bad load must raise on every rank and leave the engine exactly as it was."""
    engine, *_ = zeroedu.initialize(model=make("gpt"), config=cfg(2, world))
    train(engine, "gpt", rank, world, 1)
    out = {}

    def attempt(name, eng, *args, **kw):
        before = snapshot(eng)
        try:
            eng.load_checkpoint(*args, **kw)
            out[name] = None
        except CheckpointError as e:
            out[name] = str(e)
        out[name + "/unchanged"] = same_snapshot(before, snapshot(eng))

    for name, d, tag in cases:
        attempt(name, engine, d, tag)
    attempt("not strict", engine, good, load_module_strict=False)
    other, *_ = zeroedu.initialize(model=TinyGPT(TinyGPTConfig(vocab_size=100)), config=cfg(2, world))
    attempt("shape", other, good)
    sgd, *_ = zeroedu.initialize(model=make("gpt"), config=cfg(1, world, optimizer="SGD"))
    attempt("optimizer", sgd, good)
    attempt("weights only", sgd, good, load_optimizer_states=False)
    out["weights only/params"] = sgd.master_state_dict()
    out["weights only/counters"] = (sgd.global_step, sgd.micro_step)
    # DeepSpeed's load_module_only: the weights, and nothing else (counters, Adam state, RNG stay)
    before = snapshot(engine)
    engine.load_checkpoint(good, load_module_only=True, load_lr_scheduler_states=False)
    after = snapshot(engine)
    out["module only"] = {"params": after["state"]["params"], "kept": (
        after["counters"] == before["counters"] and torch.equal(after["rng"], before["rng"])
        and after["state"]["step"] == before["state"]["step"]
        and all(torch.equal(after["state"][p][k], before["state"][p][k])
                for p in ("exp_avg", "exp_avg_sq") for k in before["state"][p]))}
    accum, *_ = zeroedu.initialize(model=make("gpt"), config=cfg(2, world, accum=2))
    xs, ys = shard_batch(*batch("gpt", 0, 8), rank, world, 0, 2)
    accum.backward(loss_fn(accum(xs), ys))
    accum.step()
    try:
        accum.save_checkpoint(good + "-never")
        out["mid-accumulation"] = None
    except CheckpointError as e:
        out["mid-accumulation"] = str(e)
    return out


def corrupt(src: str, dst: str, how: str, other: str) -> str:
    shutil.copytree(src, dst)
    tag = open(os.path.join(dst, "latest")).read()
    d = os.path.join(dst, tag)
    if how == "missing shard":
        os.remove(os.path.join(d, "rank1.pt"))
    elif how == "truncated":
        f = os.path.join(d, "rank0.pt")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2])
    elif how == "tampered":
        f = os.path.join(d, "rank1.pt")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(f, "wb").write(bytes(data))
    elif how == "other model":
        shutil.copy(os.path.join(other, tag, "metadata.json"), os.path.join(d, "metadata.json"))
    elif how == "edited metadata":
        meta = json.load(open(os.path.join(d, "metadata.json")))
        meta["parameters"][0]["shape"] = [64, 128]
        json.dump(meta, open(os.path.join(d, "metadata.json"), "w"))
    elif how == "truncated metadata":
        f = os.path.join(d, "metadata.json")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2])
    elif how == "no metadata":
        os.remove(os.path.join(d, "metadata.json"))
    elif how == "unsafe pickle":   # a file that only full unpickling could load, with hashes made to match
        f = os.path.join(d, "rank0.pt")
        pad = bytes(os.path.getsize(f))   # as large as the real shard: the metadata's size checks pass
        torch.save({"format": "zeroedu-checkpoint", "payload": argparse.Namespace(x=1), "pad": pad}, f)
        meta = json.load(open(os.path.join(d, "metadata.json")))
        meta["files"][0].update(bytes=os.path.getsize(f), sha256=hashlib.sha256(open(f, "rb").read()).hexdigest())
        body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
        meta["metadata_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        json.dump(meta, open(os.path.join(d, "metadata.json"), "w"))
    return dst


BAD = {   # case: what the error must say
    "missing shard": "rank1.pt is missing",
    "truncated": "rank0.pt is truncated",
    "truncated metadata": "metadata.json cannot be read as JSON",
    "tampered": "rank1.pt was modified or corrupted after it was saved",
    "other model": "metadata.json describes a different model",
    "edited metadata": "metadata.json was modified after it was saved",
    "no metadata": "metadata.json is missing",
    "unsafe pickle": "rank0.pt cannot be loaded with torch.load(weights_only=True)",
}


def test_bad_checkpoints_raise_clear_errors_and_change_nothing(saved, bad_dirs, loaded):
    root, results = saved
    good, dirs = bad_dirs
    for how, d in dirs.items():   # consolidation checks the same things
        with pytest.raises(CheckpointError, match=BAD[how].replace("(", r"\(").replace(")", r"\)")
                           if how != "other model" else "metadata.json comes from another checkpoint"):
            checkpoint.consolidate(d)
    out = [loaded[2][rank]["bad"] for rank in range(2)]
    expect = {**BAD, "missing tag": "no checkpoint 'nope'",
              "not strict": "load_module_strict=False is not implemented",
              "shape": "shape mismatch for parameter 'wte.weight': [128, 64] in the checkpoint, [100, 64]",
              "optimizer": "holds Adam state, this engine uses SGD",
              "mid-accumulation": "in the middle of gradient accumulation"}
    saved_params = results[2][0][key("gpt", 2, 2)]["saved"]["params"]
    for rank, r in enumerate(out):
        for case, words in expect.items():
            assert r[case] is not None and words in r[case], (rank, case, r[case])
            if case != "mid-accumulation":
                assert r[case + "/unchanged"], (rank, case)   # weights, Adam state, counters, RNG
        assert r["weights only"] is None
        assert_same(r["weights only/params"], saved_params, "weights only")
        assert r["weights only/counters"] == (K, K)
        assert_same(r["module only"]["params"], saved_params, "load_module_only")
        assert r["module only"]["kept"], rank
    assert "failed on rank 1" in out[0]["missing shard"]   # only rank 1 reads rank1.pt; rank 0 still refused


# -- atomic saves ---------------------------------------------------------------------------------------------

def crash_while_writing(rank: int, world: int, d: str) -> None:
    """Rank 1 dies halfway through writing its shard of a new tag."""
    engine, *_ = zeroedu.initialize(model=make("quirky"), config=cfg(1, world))
    engine.load_checkpoint(d)
    train(engine, "quirky", rank, world, 1)
    if rank == 1:
        real = torch.save

        def half_then_die(obj, f, *a, **kw):
            real(obj, f, *a, **kw)
            f.flush()
            f.truncate(f.tell() // 2)
            f.flush()
            os._exit(1)

        torch.save = half_then_die
    engine.save_checkpoint(d, "b")


def crash_while_replacing(rank: int, world: int, d: str, tag: str) -> None:
    """Save tag "b" (over the crashed attempt), then die between moving the old `tag` aside and the new in."""
    engine, *_ = zeroedu.initialize(model=make("quirky"), config=cfg(3, world))
    engine.load_checkpoint(d, tag)
    train(engine, "quirky", rank, world, 1)
    engine.save_checkpoint(d, "b")
    real, calls = os.rename, []

    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            os._exit(1)
        real(a, b)

    os.rename = rename
    engine.save_checkpoint(d, tag)


def test_crash_mid_save_keeps_previous_checkpoint(saved, tmp_path):
    root, results = saved
    d = str(tmp_path / "ck")
    shutil.copytree(os.path.join(root, key("quirky", 1, 2)), d)
    tag = open(os.path.join(d, "latest")).read()
    before = checkpoint.consolidate(d)
    with pytest.raises(zeroedu.launch.LaunchError, match="rank 1"):
        zeroedu.launch(crash_while_writing, world_size=2, args=(d,), timeout=200)
    assert os.path.exists(os.path.join(d, ".b.partial", "rank1.pt"))     # it really died mid-save
    with pytest.raises(CheckpointError, match="a save of it was interrupted"):
        checkpoint.consolidate(d, "b")
    assert open(os.path.join(d, "latest")).read() == tag
    assert_same(checkpoint.consolidate(d), before, "previous after a crashed write")

    with pytest.raises(zeroedu.launch.LaunchError):
        zeroedu.launch(crash_while_replacing, world_size=1, args=(d, tag), timeout=200)
    assert not os.path.exists(os.path.join(d, tag))                        # died between the two renames
    assert_same(checkpoint.consolidate(d, tag), before, "previous after a crashed replace")
    assert not os.path.exists(os.path.join(d, ".b.partial"))
    assert checkpoint.read_metadata(os.path.join(d, "b"))["world_size"] == 1
    assert checkpoint.consolidate(d, "b").keys() == before.keys()


# -- hostile metadata, interrupted commits, a full disk ---------------------------------------------------------

def save_small(rank: int, world: int, d: str, tag: str) -> None:
    engine, *_ = zeroedu.initialize(model=make("quirky"), config=cfg(1, world))
    train(engine, "quirky", rank, world, 1)
    engine.save_checkpoint(d, tag)


def load_refused(rank: int, world: int, dirs: list[str]) -> list[str | None]:
    engine, *_ = zeroedu.initialize(model=make("quirky"), config=cfg(1, world))
    out = []
    for d in dirs:
        try:
            engine.load_checkpoint(d)
            out.append(None)
        except CheckpointError as e:
            out.append(str(e))
    return out


def rehash(meta_file: str, edit) -> None:
    """Edit a metadata.json and make its self-hash match again, as anyone crafting one can."""
    meta = json.load(open(meta_file))
    edit(meta)
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    meta["metadata_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    json.dump(meta, open(meta_file, "w"))


class FifoWatch:
    """A named pipe that records whether anything opened it for reading: opening a FIFO for reading blocks
    until a writer comes, and a non-blocking open for writing succeeds only while a reader is there."""

    def __init__(self, path: str) -> None:
        import threading
        os.mkfifo(path)
        self.path, self.opened, self.stop = path, False, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import time
        while not self.stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:          # ENXIO: no reader
                time.sleep(0.005)
                continue
            self.opened = True
            os.close(fd)             # the reader sees EOF and goes on

    def close(self) -> bool:
        self.stop.set()
        self.thread.join(2)
        return self.opened


@pytest.mark.timeout(180)
def test_metadata_naming_a_file_outside_the_checkpoint_is_refused_before_opening(tmp_path):
    good = str(tmp_path / "good")
    zeroedu.launch(save_small, world_size=2, args=(good, "t"))
    fifo = FifoWatch(str(tmp_path / "secret"))     # outside every checkpoint folder
    crafted = {}
    for how in ("absolute", "relative", "symlink"):
        d = str(tmp_path / how)
        shutil.copytree(good, d)
        shard = os.path.join(d, "t", "rank1.pt")
        if how == "symlink":                       # a plain name, but a link that leads out of the folder
            os.remove(shard)
            os.symlink(fifo.path, shard)
        else:
            name = fifo.path if how == "absolute" else "../../secret"
            rehash(os.path.join(d, "t", "metadata.json"), lambda m, name=name: m["files"][1].update(name=name))
        crafted[how] = d
    try:
        for d in crafted.values():
            with pytest.raises(CheckpointError, match="which is not a file inside"):
                checkpoint.consolidate(d)
        loads = zeroedu.launch(load_refused, world_size=2, args=(list(crafted.values()),))
    finally:
        opened = fifo.close()
    assert not opened, "a shard path outside the checkpoint folder was opened"
    for rank in range(2):
        for how, msg in zip(crafted, loads[rank], strict=True):
            assert msg is not None and "is not a file inside" in msg and "refused" in msg, (rank, how, msg)
    assert checkpoint.consolidate(good).keys()      # the untouched copy still loads


def test_an_interrupted_commit_lists_the_tag_that_still_loads(tmp_path):
    src = tmp_path / "src"
    zeroedu.launch(save_small, world_size=2, args=(str(src), "kept"))
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    # What a crash between the commit's two renames leaves: the old checkpoint moved aside, the new not in yet.
    os.rename(os.path.join(d, "kept"), os.path.join(d, ".kept.previous"))
    with pytest.raises(CheckpointError, match=r"tags here: \['kept'\]"):
        checkpoint.resolve(d, "nope")
    os.remove(os.path.join(d, "latest"))
    with pytest.raises(CheckpointError, match=r"tags here: \['kept'\]"):
        checkpoint.resolve(d)
    assert_same(checkpoint.consolidate(d, "kept"), checkpoint.consolidate(str(src), "kept"), "the moved-aside one")


def save_twice(rank: int, world: int, d: str, fsize_limit: bool) -> dict:
    """Save "a", then "b" where it cannot fit; report what the second save said and what is left."""
    import resource
    import signal
    engine, *_ = zeroedu.initialize(model=make("quirky"), config=cfg(1, world))
    train(engine, "quirky", rank, world, 1)
    engine.save_checkpoint(d, "a")
    train(engine, "quirky", rank, world, 1)
    mine = os.path.getsize(os.path.join(d, "a", f"rank{rank}.pt"))
    if fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (mine // 2, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        engine.save_checkpoint(d, "b")
        error = None
    except CheckpointError as e:
        error = str(e)
    dist.barrier()
    return {"error": error, "a_bytes": mine, "left": sorted(os.listdir(d)),
            "latest": open(os.path.join(d, "latest")).read(),
            "a_loads": sorted(checkpoint.consolidate(d, "a")) == sorted(engine.module.state_dict())}


DISK_FULL_SCRIPT = """
import json, sys
sys.path[:0] = [{tests!r}]
import test_checkpoint, zeroedu
if __name__ == "__main__":
    print("RESULT " + json.dumps(zeroedu.launch(test_checkpoint.save_twice, world_size=2, args=(sys.argv[1], False))))
"""


def check_disk_full_result(results: list[dict], kind: str) -> None:
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors     # every rank raises the same error
    m = re.search(r"rank(\d)\.pt needs ([\d,]+) bytes, ([\d,]+) bytes are free" if kind == "tmpfs" else
                  r"rank(\d)\.pt needs ([\d,]+) bytes, but this process may write files of at most ([\d,]+) bytes",
                  errors[0])
    assert m, errors[0]
    rank, need, have = int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))
    assert need == results[rank]["a_bytes"]    # the same shard, one step later: the same size on disk
    assert have < need
    for r in results:
        assert r["left"] == ["a", "latest"], r["left"]    # the partial folder is gone, "a" stays and loads
        assert r["latest"] == "a" and r["a_loads"]


@pytest.mark.timeout(180)
def test_disk_full_during_save_names_the_bytes_and_removes_the_partial_folder(tmp_path):
    """A real tmpfs too small for a second checkpoint, mounted in a private mount namespace."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs `unshare -rm` to mount a small tmpfs (the file-size limit test covers the rest)")
    script = tmp_path / "full.py"
    script.write_text(DISK_FULL_SCRIPT.format(tests=os.path.dirname(__file__)))
    d = tmp_path / "small"
    d.mkdir()
    # one checkpoint of this model takes about 40 KiB: room for one, not two
    cmd = f'mount -t tmpfs -o size=64k tmpfs "$1" && exec "{sys.executable}" "{script}" "$1"'
    out = subprocess.run(["unshare", "-rm", "sh", "-c", cmd, "sh", str(d)], capture_output=True, text=True,
                         timeout=170, cwd=tmp_path)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout + out.stderr
    results = json.loads(lines[0][len("RESULT "):])
    check_disk_full_result(results, "tmpfs")
    assert "no space left on tmpfs (mounted on " in results[0]["error"]


@pytest.mark.timeout(180)
def test_file_size_limit_during_save_names_the_bytes_and_removes_the_partial_folder(tmp_path):
    results = zeroedu.launch(save_twice, world_size=2, args=(str(tmp_path / "ck"), True))
    check_disk_full_result(results, "rlimit")
    assert "RLIMIT_FSIZE" in results[0]["error"]
