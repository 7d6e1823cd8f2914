"""Offload (zeroedu/engine/extras/offload/): CPU and NVMe tiers, on real gloo ranks and real files.

References, none taken from the code under test: the same training without offload (bit for bit: offload
changes where the bytes live, never the arithmetic, when the host runs torch's fused Adam, which is what the
engine runs on CPU without offload); a single-process run on the global batch; and the closed forms below,
per rank, in bytes. S = this rank's shard (the padded layout / N elements), p = compute-dtype bytes (4 fp32,
2 bf16), A = gradient-accumulation steps, m = the largest bucket piece, k = offload_optimizer's buffer_count,
j = offload_param's buffer_count, 8 = Adam's moments:

  device, offload_optimizer: stage 1  parameters p*F, gradients p*F (F = padded layout: full flat buffers)
                             stage 2  parameters p*F, gradients 0
                             stage 3  parameters p*S (0 with offload_param), gradients 0; no master, no state
          offload_param alone: parameters 0, and in fp32 the master 4*S stays (it was the parameter shard)
  host,   offload_optimizer cpu: master 4*S (fp32 too: the device's parameters cannot double as the host's
                                 master), optimizer state 8*S, gradients p*S
          offload_optimizer nvme: master k*4*m, optimizer state k*8*m (independent of Psi), gradients p*S
          offload_param cpu: parameters p*S;  offload_param nvme: parameters j*p*m (independent of Psi)
  nvme    master 4*S, optimizer state 8*S (offload_optimizer nvme), parameters p*S (offload_param nvme)
  traffic per step: d2h p*S (x A at stages 2-3, which reduce every micro-step); h2d p*S (updated parameters,
          unless offload_param); nvme2h = h2nvme = 12*S (optimizer nvme); offload_param: forward and backward
          each bring p*S per micro-step to the device (h2d, and nvme2h first at nvme; with hpZ the backward
          reads ZeRO++'s secondary copy instead), and the step writes p*S (h2nvme at nvme)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import cloudpickle
import pytest
import torch

import zeroedu
from zeroedu import bench, offload
from zeroedu.launch import RankError

from reference import param_rel, rel, single_process

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(420)

N = 2
STEPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}


def cfg(stage: int, precision: str = "fp32", opt: str = "none", param: str = "none", path: str = "", accum: int = 1,
        buffers: int = 2, param_buffers: int = 3, bucket: int = 3000, clip: float = 0.0, **zero) -> dict:
    def tier(device: str, count: int) -> dict:
        if device == "nvme":
            return {"device": "nvme", "nvme_path": path, "buffer_count": count}
        return {"device": device}

    return {
        "train_micro_batch_size_per_gpu": 4 // accum, "gradient_accumulation_steps": accum,
        "gradient_clipping": clip, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": precision == "bf16"},
        # fp16: a loss scale that overflows at the first steps (this model and data), so some steps are skipped
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 20, "hysteresis": 1},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": tier(opt, buffers), "offload_param": tier(param, param_buffers),
                              **zero},
    }


def run(rank: int, world: int, model: str, config: dict, steps: int = STEPS, adam: str = "fused") -> dict:
    """Train; return losses, weights, memory by tier, the offload ledger, the layout, and what close() did."""
    import torch.distributed as dist

    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    from reference import batch, loss_fn, make

    offload.CPU_ADAM = adam
    sizes = tuple(model[1]) if isinstance(model, tuple) else None
    net = MLP(sizes, seed=0) if sizes else make(model)
    try:
        engine, *_ = zeroedu.initialize(model=net, config=config)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    accum = config["gradient_accumulation_steps"]
    losses, skipped = [], []
    for s in range(steps):
        x, y = mlp_batch(s, 8, sizes) if sizes else batch(model, s, 8)
        total = torch.zeros(())
        for micro in range(accum):
            xs, ys = shard_batch(x, y, rank, world, micro, accum)
            out = engine(xs)
            loss = mlp_loss(out, ys) if sizes else loss_fn(out, ys)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(float(total) / (world * accum))
        skipped.append(engine.skipped_steps > sum(skipped))   # fp16: did this step overflow and skip?
    folders = list(getattr(engine, "swap_folders", []))
    zc = config["zero_optimization"]
    out = {
        "losses": losses, "params": engine.master_state_dict(), "memory": engine.memory(),
        "moved": {s: engine.ledger.by("op", kind="offload", step=s) for s in range(steps)},
        "moved_by_phase": engine.ledger.by("phase", "op", kind="offload", step=1),
        "collectives": engine.ledger.per_step(1), "skipped": skipped,
        "full": engine.layout.full_numel, "shard": engine.layout.shard_numel,
        "max_piece": max(b.piece for b in engine.layout.buckets), "buckets": len(engine.layout.buckets),
        "psi": sum(b.numel for b in engine.layout.buckets), "layout": [b.numel for b in engine.layout.buckets],
        "buffer_count": zc["offload_optimizer"].get("buffer_count", 0),
        "param_buffer_count": zc["offload_param"].get("buffer_count", 0),
        "folders_before_close": [os.path.isdir(f) for f in folders],
    }
    if hasattr(engine, "close"):
        engine.close()
    out["folders_after_close"] = [os.path.isdir(f) for f in folders]
    return out


TIER_RUNS = [   # (stage, precision, offload_optimizer, offload_param), NVMe buffer counts varied along the way
    *[(s, prec, opt, "none") for s in (1, 2, 3) for prec in ("fp32", "bf16") for opt in ("cpu", "nvme")],
    (3, "bf16", "cpu", "cpu"), (3, "fp32", "cpu", "cpu"), (3, "fp32", "nvme", "nvme"), (3, "bf16", "nvme", "nvme"),
    (3, "bf16", "none", "cpu"), (3, "fp32", "none", "nvme"), (3, "fp32", "nvme", "cpu"), (3, "bf16", "cpu", "nvme"),
    (2, "fp16", "cpu", "none"),
]


def runs_for(path: str) -> list[tuple]:
    runs = [((s, prec, "none", "none"), "gpt", cfg(s, prec)) for s in (1, 2, 3) for prec in ("fp32", "bf16")]
    runs.append(((2, "fp16", "none", "none"), "gpt", cfg(2, "fp16")))
    for i, (s, prec, opt, param) in enumerate(TIER_RUNS):
        runs.append(((s, prec, opt, param), "gpt", cfg(s, prec, opt, param, path=path, buffers=1 + i % 3,
                                                       param_buffers=1 + i % 2)))
    runs += [
        # gradient accumulation (stage 2 reduces every micro-step) and the awkward model with clipping
        ("accum-none", "gpt", cfg(2, "bf16", accum=2)),
        ("accum-cpu", "gpt", cfg(2, "bf16", "cpu", accum=2)),
        ("quirky-none", "quirky", cfg(3, "fp32", accum=2, bucket=60, clip=0.05)),
        ("quirky-nvme", "quirky", cfg(3, "fp32", "nvme", "nvme", path=path, accum=2, bucket=60, clip=0.05)),
        # ZeRO++ composed with offload: hpZ's secondary copy serves the backward gathers instead of the host
        # units below the persistence threshold stay whole on the device and are gathered after the step
        ("persist", "gpt", cfg(3, "bf16", stage3_param_persistence_threshold=2000)),
        ("persist+param", "gpt", cfg(3, "bf16", "cpu", "nvme", path=path, stage3_param_persistence_threshold=2000)),
        ("hpz", "gpt", cfg(3, "fp32", zero_hpz_partition_size=2)),
        ("hpz+param", "gpt", cfg(3, "fp32", "cpu", "cpu", zero_hpz_partition_size=2)),
        ("qwz+qgz", "gpt", cfg(3, "bf16", zero_quantized_weights=True, zero_quantized_gradients=True)),
        ("qwz+qgz+offload", "gpt", cfg(3, "bf16", "nvme", "cpu", path=path, zero_quantized_weights=True,
                                       zero_quantized_gradients=True)),
    ]
    # Two MLPs of the same width, one twice as deep: one bucket (stage 3: one unit) per layer, NVMe for both tiers.
    for depth in (3, 6):
        sizes = (32,) + (128,) * depth + (10,)
        for s in (2, 3):
            runs.append(((f"mlp{depth}", s), ("mlp", sizes), cfg(s, "fp32", "nvme", "nvme" if s == 3 else "none",
                                                                  path=path, bucket=128 * 129)))
    return runs


def resumed(rank: int, world: int, save: dict, load: dict, folder: str) -> dict:
    """Train 2 steps, save, train 2 more; a fresh engine (other seed, maybe another tier) loads and trains the
    same 2 steps. zeroedu.checkpoint reaches NVMe state through the mixin's checkpoint hooks."""
    from zeroedu.models import shard_batch

    from reference import batch, loss_fn, make

    offload.CPU_ADAM = "loop"

    def steps(engine, rng) -> list[float]:
        out = []
        for s in rng:
            xs, ys = shard_batch(*batch("gpt", s, 8), rank, world)
            loss = loss_fn(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            out.append(float(loss))
        return out

    first, *_ = zeroedu.initialize(model=make("gpt"), config=save)
    steps(first, range(2))
    first.save_checkpoint(folder, "two")
    want = steps(first, range(2, 4)), first.master_state_dict()
    second, *_ = zeroedu.initialize(model=make("gpt", seed=5), config=load)
    second.load_checkpoint(folder, "two")
    got = steps(second, range(2, 4)), second.master_state_dict()
    for e in (first, second):
        e.close()
    return {"losses": (want[0], got[0]), "params": (want[1], got[1])}


def watched_prefetch(rank: int, world: int, path: str) -> dict:
    """Stage 3 with parameters on NVMe: which units the stage prefetched, and on which thread each piece came from
    its tier (observed by overriding two methods in a subclass of the engine's own class)."""
    import threading

    from zeroedu.compose import engine_class
    from zeroedu.models import shard_batch

    from reference import batch, loss_fn, make

    config = zeroedu.load_config(cfg(3, "bf16", "cpu", "nvme", path=path))
    log: dict[str, list] = {"prefetched": [], "pieces": []}

    class Watched(engine_class(config)):
        def prefetch(self, calls: range) -> None:
            before = set(self.inflight)
            super().prefetch(calls)
            log["prefetched"] += [(self.global_step, u) for u in set(self.inflight) - before]

        def param_piece(self, b):
            main = threading.current_thread() is threading.main_thread()
            log["pieces"].append((self.global_step, self.comm.phase, b.index, main))
            return super().param_piece(b)

    engine = Watched(make("gpt"), config)
    for s in range(STEPS):
        xs, ys = shard_batch(*batch("gpt", s, 8), rank, world)
        engine.backward(loss_fn(engine(xs), ys))
        engine.step()
    engine.close()
    return {**log, "units": len(engine.layout.buckets)}


def many(rank: int, world: int, runs: list[tuple], path: str) -> dict:
    out = {key: run(rank, world, model, c, steps=2 if str(key[0]).startswith("mlp") else STEPS)   # mlp: bytes only
           for key, model, c in runs}
    out["fused"] = run(rank, world, "gpt", cfg(2, "fp32", "cpu"), adam="loop")
    out["prefetch"] = watched_prefetch(rank, world, path)
    out["resume-nvme"] = resumed(rank, world, cfg(3, "bf16", "nvme", "nvme", path=path),
                                 cfg(3, "bf16", "nvme", "nvme", path=path), os.path.join(path, "ck1"))
    out["resume-cpu-to-nvme"] = resumed(rank, world, cfg(2, "fp32", "cpu"), cfg(2, "fp32", "nvme", path=path),
                                        os.path.join(path, "ck2"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    res = zeroedu.launch(many, world_size=N, args=(runs_for(path), path), timeout=400)
    return res, path


def offloaded(res):
    return {k: v for k, v in res[0].items() if isinstance(k, tuple) and len(k) == 4 and k[2:] != ("none", "none")}


# -- same numbers as without offload -----------------------------------------------------------------------------

PAIRS = [("accum-cpu", "accum-none"), ("quirky-nvme", "quirky-none"), ("hpz+param", "hpz"),
         ("qwz+qgz+offload", "qwz+qgz"), ("persist+param", "persist")]


def same_run(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], v) for k, v in b["params"].items())


def test_offload_equals_no_offload_bit_for_bit(results):
    res, _ = results
    r0 = res[0]
    assert {k[:2] for k in offloaded(res) if k[3] == "none"} >= {(s, p) for s in (1, 2, 3) for p in ("fp32", "bf16")}
    for key, r in offloaded(res).items():
        assert "error" not in r, (key, r.get("error"))
        assert same_run(r, r0[(key[0], key[1], "none", "none")]), key
    for a, b in PAIRS:
        assert same_run(r0[a], r0[b]), a
    for other in res[1:]:   # every rank ends with the same model
        for key in [*offloaded(res), *(a for a, _ in PAIRS)]:
            assert param_rel(other[key]["params"], r0[key]["params"]) == 0.0, key


def test_fp16_skips_the_same_steps_with_offload(results):
    """fp16's loss scale starts high enough to overflow: a skipped step skips the host step too."""
    r = results[0][0]
    base, off = r[(2, "fp16", "none", "none")], r[(2, "fp16", "cpu", "none")]
    assert off["skipped"] == base["skipped"] and any(base["skipped"][1:]) and not all(base["skipped"])
    for s, skipped in list(enumerate(off["skipped"]))[1:]:   # step 0 also holds the copies made at setup
        assert off["moved"][s]["d2h"] == 2 * off["shard"]                     # the gradients went to the host ...
        assert off["moved"][s].get("h2d", 0) == (0 if skipped else 2 * off["shard"])   # ... nothing came back


def test_no_offload_runs_match_single_process(results):
    """Anchors the baseline itself to an independent reference (fp32: exact up to rounding)."""
    res, _ = results
    ref_losses, ref_params = single_process("gpt", steps=STEPS)
    for s in (1, 2, 3):
        r = res[0][(s, "fp32", "none", "none")]
        assert rel(r["losses"], ref_losses) < 1e-6 and param_rel(r["params"], ref_params) < 1e-6, s
    q_losses, q_params = single_process("quirky", steps=STEPS, clip=0.05)
    assert rel(res[0]["quirky-nvme"]["losses"], q_losses) < 1e-6
    assert param_rel(res[0]["quirky-nvme"]["params"], q_params) < 1e-6


def test_fused_cpu_adam_within_rounding(results):
    """torch's loop Adam on the host computes the device's fused update in another order: equal within float32
    rounding, not bit for bit."""
    res, _ = results
    r, base = res[0]["fused"], res[0][(2, "fp32", "none", "none")]
    assert rel(r["losses"], base["losses"]) < 1e-6
    assert param_rel(r["params"], base["params"]) < 1e-5


def test_checkpoint_resumes_exactly_from_nvme(results):
    res, _ = results
    for key in ("resume-nvme", "resume-cpu-to-nvme"):
        (want, got), (pw, pg) = res[0][key]["losses"], res[0][key]["params"]
        assert want == got, key
        assert all(torch.equal(pw[k], pg[k]) for k in pw), key


def test_collectives_unchanged_by_offload(results):
    """Offload moves bytes between tiers, never between ranks: the collectives of a step are the same."""
    res, _ = results
    for key, r in offloaded(res).items():
        assert r["collectives"] == res[0][(key[0], key[1], "none", "none")]["collectives"], key
    for a, b in PAIRS:
        assert res[0][a]["collectives"] == res[0][b]["collectives"], a


# -- bytes by tier against the closed forms --------------------------------------------------------------------

def expected_tiers(key: tuple, r: dict) -> dict[str, dict[str, int]]:
    stage, prec, opt, param = key
    p = PRECISIONS[prec]
    S, F, m, k, j = r["shard"], r["full"], r["max_piece"], r["buffer_count"], r["param_buffer_count"]
    device = {"parameters": p * F if stage < 3 else (0 if param != "none" else p * S),
              "gradients": p * F if stage == 1 else (p * S if opt == "none" else 0),
              "master_weights": 0 if opt != "none" else (4 * S if p == 2 or param != "none" else 0),
              "optimizer_state": 0 if opt != "none" else 8 * S}
    host = {"parameters": {"cpu": p * S, "nvme": j * p * m}.get(param, 0),
            "gradients": p * S if opt != "none" else 0,
            "master_weights": {"cpu": 4 * S, "nvme": k * 4 * m}.get(opt, 0),
            "optimizer_state": {"cpu": 8 * S, "nvme": k * 8 * m}.get(opt, 0)}
    nvme = {"parameters": p * S if param == "nvme" else 0,
            "master_weights": 4 * S if opt == "nvme" else 0, "optimizer_state": 8 * S if opt == "nvme" else 0}
    return {"device": device, "host": host, "nvme": nvme}


def test_bytes_by_tier_equal_the_closed_forms(results):
    res, _ = results
    for key, r in offloaded(res).items():
        want = expected_tiers(key, r)
        tiers = r["memory"]["tiers"]
        for tier in ("device", "host", "nvme"):
            got = tiers.get(tier, {})
            for cat, b in want[tier].items():
                assert got.get(cat, 0) == b, (key, tier, cat, got.get(cat, 0), b)
        assert r["memory"]["device"] == "cpu"   # this machine: the device is the CPU, tiers are accounting


def test_tiers_equal_theory_offload_bytes(results):
    """zeroedu.theory.offload_bytes with separate_fp32_master=True (zeroedu, like DeepSpeed, keeps its own fp32
    master whenever the optimizer or the parameters leave the device) and the compute dtype for the host's
    gradient shard is what zeroedu holds, every setting; offload_nvme_buffer_bytes is the host's NVMe buffers."""
    from zeroedu import theory

    res, _ = results
    for key, r in offloaded(res).items():
        stage, prec, opt, param = key
        want = theory.offload_bytes(r["psi"], N, stage, prec, opt, param, layout=r["layout"],
                                    host_grad_bytes=PRECISIONS[prec], separate_fp32_master=True)
        staged = theory.offload_nvme_buffer_bytes(r["layout"], N, prec, opt, param, r["buffer_count"] or 4,
                                                  r["param_buffer_count"] or 5)
        got = r["memory"]["tiers"]
        for tier in ("device", "host", "nvme"):
            for cat in ("parameters", "gradients", "master_weights", "optimizer_state"):
                extra = staged.get(cat, 0) if tier == "host" else 0
                assert got.get(tier, {}).get(cat, 0) == want[tier][cat] + extra, (key, tier, cat)


THEORY_OPS = {"device_to_host": "d2h", "host_to_device": "h2d", "nvme_to_host": "nvme2h", "host_to_nvme": "h2nvme"}


def test_transfers_equal_theory_offload_transfer_bytes(results):
    from zeroedu import theory

    res, _ = results
    runs = {**{k: (k, 1, False) for k in offloaded(res)}, "accum-cpu": ((2, "bf16", "cpu", "none"), 2, False),
            "hpz+param": ((3, "fp32", "cpu", "cpu"), 1, True)}
    for name, (key, accum, hpz) in runs.items():
        r = res[0][name]
        stage, prec, opt, param = key
        want = theory.offload_transfer_bytes_per_step(r["psi"], N, stage, prec, opt, param, layout=r["layout"],
                                                      grad_accum=accum, separate_fp32_master=True, hpz=hpz)
        by_op: dict[str, int] = {}
        for k, v in want.items():
            if "/" in k:
                op = THEORY_OPS[k.split("/")[0]]
                by_op[op] = by_op.get(op, 0) + v
        assert not r["skipped"][-1], name   # fp16: the scale has settled by the last step
        assert r["moved"][STEPS - 1] == by_op, (name, r["moved"][STEPS - 1], by_op)
        assert sum(r["moved"][STEPS - 1].values()) == want["total"]


def test_transfer_bytes_per_step_equal_the_closed_forms(results):
    res, _ = results
    for key, r in offloaded(res).items():
        stage, prec, opt, param = key
        p, S = PRECISIONS[prec], r["shard"]
        want = {}
        if opt != "none":
            want["d2h"] = p * S
        if param == "none":
            want["h2d"] = p * S
        if opt == "nvme":
            want["nvme2h"] = want["h2nvme"] = 12 * S
        if param != "none":
            want["h2d"] = 2 * p * S   # forward and backward bring the shard, one unit at a time
            want["d2h"] = want.get("d2h", 0) + (p * S if opt == "none" else 0)   # device master -> host params
        if param == "nvme":
            want["nvme2h"] = want.get("nvme2h", 0) + 2 * p * S
            want["h2nvme"] = want.get("h2nvme", 0) + p * S
        stepped = [s for s in range(1, STEPS) if not r["skipped"][s]]   # step 0 creates the optimizer state
        assert stepped, key
        for step in stepped:
            assert r["moved"][step] == want, (key, step, r["moved"][step], want)
    key = (3, "bf16", "cpu", "cpu")
    S = res[0][key]["shard"]
    assert res[0][key]["moved_by_phase"] == {("forward", "h2d"): 2 * S, ("backward", "h2d"): 2 * S,
                                             ("backward", "d2h"): 2 * S}
    a = res[0]["accum-cpu"]
    assert a["moved"][1] == {"d2h": 2 * 2 * a["shard"], "h2d": 2 * a["shard"]}   # stage 2: d2h every micro-step
    h = res[0]["hpz+param"]   # the backward gathers come from hpZ's secondary copy on the device: no h2d there
    assert h["moved_by_phase"] == {("forward", "h2d"): 4 * h["shard"], ("backward", "d2h"): 4 * h["shard"]}


def test_parameter_offload_rides_the_prefetch(results):
    """Each unit's piece comes from NVMe inside its gather's job on the comm thread, so the units the stage
    prefetches (from the second forward on, once it knows the order) arrive from their tier early too."""
    w = results[0][0]["prefetch"]
    gathered = [(step, phase, u) for step, phase, u, main in w["pieces"] if phase in ("forward", "backward")]
    assert all(not main for _, phase, _, main in w["pieces"] if phase in ("forward", "backward"))
    for step in (1, 2):
        early = {u for s, u in w["prefetched"] if s == step}
        assert len(early) >= w["units"] // 2, (step, early)           # most units were fetched ahead of use
        assert {u for s, _, u in gathered if s == step} == set(range(w["units"]))   # every unit came from NVMe
        assert early <= {u for s, _, u in gathered if s == step}


def test_nvme_host_buffers_do_not_grow_with_the_model(results):
    res, _ = results
    for s in (2, 3):
        small, big = res[0][("mlp3", s)], res[0][("mlp6", s)]
        assert big["psi"] > 1.9 * small["psi"]
        assert small["max_piece"] == big["max_piece"]
        for r in (small, big):
            host, nvme = r["memory"]["tiers"]["host"], r["memory"]["tiers"]["nvme"]
            m, k, j = r["max_piece"], r["buffer_count"], r["param_buffer_count"]
            assert host["master_weights"] == k * 4 * m and host["optimizer_state"] == k * 8 * m, s
            assert host["parameters"] == (j * 4 * m if s == 3 else 0), s
            assert nvme["master_weights"] + nvme["optimizer_state"] == 12 * r["shard"], s   # files grow instead
        h = [r["memory"]["tiers"]["host"] for r in (small, big)]
        fixed = [x["master_weights"] + x["optimizer_state"] + x["parameters"] for x in h]
        assert fixed[0] == fixed[1] > 0
        assert big["memory"]["tiers"]["nvme"]["optimizer_state"] > 1.9 * small["memory"]["tiers"]["nvme"][
            "optimizer_state"]


def test_swap_folders_removed_by_close(results):
    res, path = results
    checked = 0
    for rank in res:
        for key, r in rank.items():
            if isinstance(r, dict) and r.get("folders_before_close"):
                assert all(r["folders_before_close"]) and not any(r["folders_after_close"]), key
                checked += 1
    assert checked >= 2 * 10
    assert not [n for n in os.listdir(path) if n.startswith(offload.PREFIX)]


# -- errors before training ----------------------------------------------------------------------------------------

def test_stage_that_cannot_offload_parameters():
    for stage in (1, 2):
        with pytest.raises(zeroedu.ConfigError, match="offload_param' works only at stage 3"):
            zeroedu.load_config(cfg(stage, param="cpu"))
    with pytest.raises(zeroedu.ConfigError, match="needs ZeRO stage 1, 2 or 3"):
        zeroedu.load_config(cfg(0, opt="cpu"))


def bad_paths(rank: int, world: int, paths: dict[str, str]) -> dict[str, str]:
    return {what: run(rank, world, "gpt", cfg(2, "fp32", "nvme", path=p)).get("error", "no error")
            for what, p in paths.items()}


def test_bad_nvme_path_fails_before_training(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    # root ignores permission bits: use a folder nobody may create files in (Linux's /sys) instead
    unwritable = "/sys" if os.geteuid() == 0 and os.path.isdir("/sys") else str(locked)
    paths = {"missing": str(tmp_path / "nope"), "file": str(a_file), "unwritable": unwritable}
    errors = zeroedu.launch(bad_paths, world_size=1, args=(paths,), timeout=120)[0]
    locked.chmod(0o700)
    assert "does not exist" in errors["missing"] and "mkdir -p" in errors["missing"], errors["missing"]
    assert "is a file, not a folder" in errors["file"], errors["file"]
    assert "is not writable" in errors["unwritable"], errors["unwritable"]
    assert all(e.startswith("OffloadError") for e in errors.values())


def test_full_disk_is_checked(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(offload.OffloadError, match="bytes free"):
        offload.check_nvme_path(str(tmp_path), free + (1 << 40))
    offload.check_nvme_path(str(tmp_path), 1)


SCRIPT_HEAD = """
import os, signal, sys
import torch, zeroedu
from zeroedu import offload
from zeroedu.models import TinyGPT, gpt_batch, gpt_loss
cfg = {{"optimizer": {{"type": "Adam", "params": {{"lr": 1e-3}}}},
       "zero_optimization": {{"stage": 2, "reduce_bucket_size": 3000,
                              "offload_optimizer": {{"device": "nvme", "nvme_path": {path!r}, "buffer_count": 2}}}}}}
"""


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **env})


def test_no_space_left_fails_before_training(tmp_path):
    """A file-size limit makes the swap file's space reservation fail, as a full disk does."""
    code = SCRIPT_HEAD.format(path=str(tmp_path)) + textwrap.dedent("""
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # report EFBIG instead of dying of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            zeroedu.initialize(model=TinyGPT(), config=cfg)
        except offload.OffloadError as e:
            print("ERROR", e)
    """)
    out = python(code)
    assert "ERROR" in out.stdout and "not enough space" in out.stdout, out.stdout + out.stderr[-3000:]


def test_killed_during_nvme_step_next_run_starts_clean(tmp_path):
    path = str(tmp_path)
    killed = SCRIPT_HEAD.format(path=path) + textwrap.dedent("""
        writes = []
        original = offload.OffloadMixin._swap_out
        def swap_out_then_die(self, i, step):
            original(self, i, step)
            writes.append(i)
            if len(writes) == 3:   # in the middle of the step's sub-groups
                os.kill(os.getpid(), signal.SIGKILL)
        offload.OffloadMixin._swap_out = swap_out_then_die
        engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
        print("FOLDER", engine.swap_folders[0], flush=True)
        x, y = gpt_batch(0, 2)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
        print("NOT KILLED")
    """)
    out = python(killed)
    assert out.returncode == -signal.SIGKILL, out.stdout + out.stderr[-3000:]
    stale = out.stdout.split("FOLDER ")[1].split()[0]
    assert os.path.isdir(stale) and os.path.exists(os.path.join(stale, offload.MARKER))
    assert os.path.getsize(os.path.join(stale, "optimizer_state.exp_avg.bin")) > 0

    # The next run: removes the stale folder, says so, trains, and removes its own folder at exit.
    again = SCRIPT_HEAD.format(path=path) + textwrap.dedent("""
        engine, *_ = zeroedu.initialize(model=TinyGPT(), config=cfg)
        x, y = gpt_batch(0, 2)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
        print("REMOVED", engine.nvme_removed)
        print("OWN", engine.swap_folders[0])
    """)   # no close(): the interpreter's exit cleans up
    out = python(again)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"removed stale swap folder {stale}" in out.stderr and "no longer running" in out.stderr
    assert stale in out.stdout.split("REMOVED")[1]
    own = out.stdout.split("OWN ")[1].split()[0]
    assert not os.path.exists(stale) and not os.path.exists(own)
    assert not [n for n in os.listdir(path) if n.startswith(offload.PREFIX)]


def left_open(rank: int, world: int, path: str, fail: bool) -> str:
    """An NVMe engine never closed: the rank returns (or raises) with its swap folder still there."""
    engine, *_ = zeroedu.initialize(model=__import__("reference").make("gpt"), config=cfg(2, "fp32", "nvme", path=path))
    folder = engine.swap_folders[0]
    assert os.path.isdir(folder)
    if fail:
        raise RuntimeError(f"failed on purpose, leaving {folder}")
    return folder


def test_launched_ranks_delete_their_swap_folders_at_exit(tmp_path):
    """zeroedu.launch's ranks end with os._exit; the exit handlers (the swap folder's finalizer) still run."""
    folders = zeroedu.launch(left_open, world_size=N, args=(str(tmp_path), False), timeout=120)
    assert len(set(folders)) == N and not any(os.path.exists(f) for f in folders)
    with pytest.raises(RankError, match="failed on purpose"):
        zeroedu.launch(left_open, world_size=1, args=(str(tmp_path), True), timeout=120)
    assert os.listdir(tmp_path) == []


def test_live_owners_folder_is_kept(tmp_path):
    """A folder whose owner still runs (this test process) is never removed, whatever its age."""
    folder = tmp_path / f"{offload.PREFIX}rank0-pid{os.getpid()}-x"
    folder.mkdir()
    (folder / offload.MARKER).write_text(f"{os.getpid()} {__import__('socket').gethostname()}\n")
    unmarked = tmp_path / f"{offload.PREFIX}rank1-pid1-y"   # being created: no marker yet
    unmarked.mkdir()
    assert offload.remove_stale(str(tmp_path)) == []
    assert folder.is_dir() and unmarked.is_dir()


# -- the host optimizer ------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_cpu_adam_implementations_agree():
    speed = bench.cpu_adam_speed(numel=200_000, pieces=4, repeats=2)
    assert set(speed) == {"loop", "foreach", "fused"}
    assert speed["foreach"]["max_abs_diff_vs_loop"] == 0.0
    assert speed["fused"]["max_abs_diff_vs_loop"] < 1e-6
    assert all(v["seconds"] > 0 for v in speed.values())


def test_host_optimizer_is_torch_adam_with_the_chosen_implementation():
    params = [torch.nn.Parameter(torch.zeros(3))]
    c = zeroedu.load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}}})
    opt = offload.host_optimizer(c, params, "fused")
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and opt.defaults["weight_decay"] == 0.5
    assert offload.host_optimizer(c, params, "loop").defaults["foreach"] is False
    with pytest.raises(ValueError, match="CPU_ADAM"):
        offload.host_optimizer(c, params, "fast")
