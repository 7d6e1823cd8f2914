"""The GPU path: NCCL between ranks, device memory read from the CUDA caching allocator, and optimizer offload
through pinned host memory on a side stream. Every test needs CUDA and skips without it, saying why;
`scripts/gpu_check.sh` runs them all in one go on a GPU machine: world size 1 on one GPU, and the multi-GPU
tests when there are more.

References, none taken from the code under test:
- a single-process run on the CPU, on the global batch (tests/reference.py): the GPU run must train the same
  model. fp32 matmuls on the GPU run without TF32, so fp32 agrees to rounding; bf16 tracks within the
  tolerances tests/test_stages.py uses between ranks;
- zeroedu.theory's closed forms, which tests/test_theory*.py check against the ZeRO paper's Figure 1 and Table 1: the
  engine's meter must count exactly those model-state bytes on the device;
- the CUDA caching allocator itself (torch.cuda.memory_allocated): what the device holds after a step, above a
  baseline taken before the model existed, must be the storages the meter counts, up to the allocator's
  rounding of each block to 512 bytes. A device buffer the meter does not show fails this.
"""

from __future__ import annotations

import gc
import sys

import cloudpickle
import pytest
import torch

import zeroedu
from zeroedu import theory

from reference import param_rel, rel, single_process

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BUILD = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
NO_CUDA = (f"needs CUDA: torch {torch.__version__} ({BUILD}) sees no GPU here; scripts/gpu_check.sh runs these "
           "tests on a machine with an NVIDIA GPU")
pytestmark = pytest.mark.timeout(600)


def needs_gpus(n: int):
    """Mark a test `gpu` (scripts/gpu_check.sh selects them) and skip it, with the reason, below n GPUs."""
    reason = NO_CUDA if GPUS == 0 else f"needs {n} GPUs, this machine has {GPUS}"

    def mark(test):
        return pytest.mark.gpu(pytest.mark.skipif(GPUS < n, reason=reason)(test))
    return mark


STAGES = (0, 1, 2, 3)
STEPS, GLOBAL_BATCH = 4, 8
ALLOCATOR_BLOCK = 512        # the caching allocator rounds every block up to a multiple of 512 bytes
FP32_TOL = 1e-4              # GPU vs CPU fp32: same arithmetic, different summation order
MIXED_TOL = 2e-2             # bf16, as in tests/test_stages.py: losses within tol, weights within 10 x tol
MLP_SIZES = (1024, 2048, 2048, 1024)   # 8.4 M parameters: the allocator's rounding is ~1e-5 of their bytes


def config(stage: int, precision: str, world: int, offload: str = "none", offload_param: str = "none") -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": zero}


# -- what runs on each rank ----------------------------------------------------------------------------------------

def _warm_up(device: torch.device) -> None:
    """Make cuBLAS/cuBLASLt create their workspaces (they come from the caching allocator and stay) for the
    forward thread and autograd's backward thread, in both dtypes, before the memory baseline is taken."""
    for dtype in (torch.float32, torch.bfloat16):
        lin = torch.nn.Linear(64, 64, device=device, dtype=dtype)
        lin(torch.randn(8, 64, device=device, dtype=dtype, requires_grad=True)).sum().backward()
    torch.cuda.synchronize(device)


def _cuda_storages(tensors) -> dict[int, int]:
    """data_ptr -> bytes of each distinct CUDA storage among tensors (views share one storage)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def gpu_train(rank: int, world: int, stage: int, precision: str = "fp32", model: str = "gpt",
              offload: str = "none", offload_param: str = "none") -> dict:
    import torch.distributed as dist

    from zeroedu.models import MLP, mlp_batch, mlp_loss, shard_batch

    from reference import batch, loss_fn, make

    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 means fp32, as on the CPU reference
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    _warm_up(device)
    gc.collect()
    baseline = torch.cuda.memory_allocated(device)

    net = MLP(MLP_SIZES, seed=0) if model == "mlp" else make(model)
    engine, *_ = zeroedu.initialize(model=net.to(device),
                                    config=config(stage, precision, world, offload, offload_param))
    losses = []
    for s in range(STEPS):
        x, y = mlp_batch(s, GLOBAL_BATCH, MLP_SIZES) if model == "mlp" else batch(model, s, GLOBAL_BATCH)
        xs, ys = shard_batch(x, y, rank, world)
        out = engine(xs.to(device))
        loss = mlp_loss(out, ys.to(device)) if model == "mlp" else loss_fn(out, ys.to(device))
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)                       # outside the engine: not in its ledger
        losses.append(float(total) / world)
    del x, y, xs, ys, out, loss, total               # nothing of the step left but what the engine keeps
    torch.cuda.synchronize(device)
    gc.collect()

    owned = engine.owned()
    device_storages = _cuda_storages(t for ts in owned.values() for t in ts)
    host = engine._host_owned() if hasattr(engine, "_host_owned") else {}
    # the host buffers that copies to and from the device go through (optimizer state never crosses the bus)
    host_tensors = [t for cat, ts in host.items() if cat in ("parameters", "gradients", "master_weights", "buckets")
                    for t in ts if isinstance(t, torch.Tensor) and t.numel()]
    offload_ops = [e for e in engine.ledger if e.kind == "offload" and e.op in ("d2h", "h2d")]
    return {
        "backend": dist.get_backend(),
        "device": str(device),
        "params_on_device": all(p.is_cuda for p in engine.params),
        # every tensor the engine keeps in a device category lives on the GPU (0-dim step counters aside)
        "off_device": sorted({cat for cat, ts in owned.items() for t in ts
                              if isinstance(t, torch.Tensor) and t.dim() > 0 and not t.is_cuda}),
        "losses": losses,
        "params": {k: v.detach().cpu() for k, v in engine.master_state_dict().items()},
        "memory": engine.memory(),
        "ledger": engine.ledger.per_step(1),
        "layout": [b.numel for b in engine.layout.buckets],
        "persistent": sorted(engine.layout.buckets[u].numel for u in getattr(engine, "persistent", ())),
        "allocated": torch.cuda.memory_allocated(device) - baseline,
        "metered": sum(device_storages.values()),
        "storages": len(device_storages),
        "host_on_cpu": all(not t.is_cuda for t in host_tensors),
        "host_pinned": [t.is_pinned() for t in host_tensors],
        "offload_impls": sorted({e.impl for e in offload_ops}),
        "moved": engine.ledger.by("op", kind="offload", step=1),
    }


def gpu_runs(rank: int, world: int, runs: list[tuple]) -> dict:
    """Several trainings in one launch (NCCL's start is the slow part)."""
    return {key: gpu_train(rank, world, **kw) for key, kw in runs}


def launch_runs(world: int, runs: list[tuple]) -> list[dict]:
    return zeroedu.launch(gpu_runs, world_size=world, args=(runs,), backend="auto", timeout=500)


# -- checks shared by one GPU and several ----------------------------------------------------------------------------

def check_against_cpu_reference(r: dict, precision: str, key) -> None:
    ref_losses, ref_params = single_process("gpt", steps=STEPS, global_batch=GLOBAL_BATCH, precision=precision)
    tol = FP32_TOL if precision == "fp32" else MIXED_TOL
    assert rel(r["losses"], ref_losses) < tol, (key, r["losses"], ref_losses)
    assert param_rel(r["params"], ref_params) < (tol if precision == "fp32" else 10 * tol), key


def check_device(r: dict, world: int, key) -> None:
    assert r["backend"] == "nccl", (key, r["backend"])
    assert r["params_on_device"] and r["off_device"] == [], (key, r["off_device"])
    assert r["memory"]["device"] == "cuda" and r["memory"]["cuda_allocated"] > 0, key


def check_model_states(r: dict, world: int, stage: int, precision: str, key) -> None:
    """The meter's device model states equal theory, and the allocator holds what the meter counts."""
    want = theory.model_state_bytes(sum(r["layout"]), world, stage, precision, "adam", layout=r["layout"])
    got = r["memory"]["tiers"]["device"]
    for cat in theory.MODEL_STATES:
        assert got.get(cat, 0) == want[cat], (key, cat, got, want)
    check_allocator(r, key)


def check_allocator(r: dict, key) -> None:
    slack = r["allocated"] - r["metered"]
    assert 0 <= slack < ALLOCATOR_BLOCK * r["storages"], (
        f"{key}: the CUDA allocator holds {r['allocated']:,} B above the baseline, the engine's tensors "
        f"{r['metered']:,} B in {r['storages']} storages: {slack:,} B not accounted for")


# -- one GPU, world size 1 -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_gpu() -> dict:
    runs = [((s, p), {"stage": s, "precision": p}) for s in STAGES for p in ("fp32", "bf16")]
    runs += [((s, "mlp"), {"stage": s, "model": "mlp"}) for s in STAGES]
    runs += [((s, "offload"), {"stage": s, "precision": "bf16", "offload": "cpu"}) for s in (1, 2, 3)]
    runs += [((3, "offload_param"), {"stage": 3, "precision": "bf16", "offload": "cpu", "offload_param": "cpu"})]
    (result,) = launch_runs(1, runs)
    return result


@needs_gpus(1)
def test_one_gpu_uses_nccl_and_keeps_the_model_on_the_device(one_gpu):
    for key, r in one_gpu.items():
        check_device(r, 1, key)


@needs_gpus(1)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_gpu_stages_match_cpu_single_process(one_gpu, precision):
    for s in STAGES:
        check_against_cpu_reference(one_gpu[(s, precision)], precision, (s, precision))


@needs_gpus(1)
def test_one_gpu_model_states_equal_theory_on_the_allocator(one_gpu):
    for (s, kind), r in one_gpu.items():
        if kind in ("fp32", "bf16", "mlp"):
            check_model_states(r, 1, s, "fp32" if kind == "mlp" else kind, (s, kind))
    # on 8.4 M parameters the device's bytes are the model states (16 per parameter) and little else
    big = one_gpu[(0, "mlp")]
    psi = sum(big["layout"])
    assert 16 * psi <= big["allocated"] < 16 * psi * 1.01 + ALLOCATOR_BLOCK * big["storages"], (big["allocated"], psi)


@needs_gpus(1)
def test_one_gpu_offload_is_pinned_on_a_side_stream(one_gpu):
    """Optimizer offload on a GPU: host buffers page-locked, copies non-blocking on a side stream, bytes per tier
    and moved per step as theory says, and training as on the CPU."""
    for (s, kind), r in one_gpu.items():
        if not kind.startswith("offload"):
            continue
        key, param = (s, kind), "cpu" if kind == "offload_param" else "none"
        check_device(r, 1, key)
        assert r["host_on_cpu"] and r["host_pinned"] and all(r["host_pinned"]), (key, r["host_pinned"])
        assert r["offload_impls"] == ["cuda_side_stream"], (key, r["offload_impls"])
        want = theory.offload_bytes(sum(r["layout"]), 1, s, "bf16", "cpu", param, layout=r["layout"],
                                    host_grad_bytes=2)   # zeroedu keeps the host gradient in the compute dtype
        for tier in ("device", "host"):
            for cat in theory.MODEL_STATES:
                assert r["memory"]["tiers"][tier].get(cat, 0) == want[tier][cat], (key, tier, cat)
        moved = theory.offload_transfer_bytes_per_step(sum(r["layout"]), 1, s, "bf16", "cpu", param,
                                                       layout=r["layout"])
        assert sum(r["moved"].values()) == moved["host_device"], (key, r["moved"], moved)
        check_allocator(r, key)
        check_against_cpu_reference(r, "bf16", key)


# -- several GPUs ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def many_gpus() -> tuple[int, list[dict]]:
    world = min(GPUS, 4)
    runs = [((s, p), {"stage": s, "precision": p}) for s in STAGES for p in ("fp32", "bf16")]
    runs += [((3, "offload"), {"stage": 3, "precision": "bf16", "offload": "cpu", "offload_param": "cpu"})]
    return world, launch_runs(world, runs)


@needs_gpus(2)
def test_gpus_match_cpu_single_process(many_gpus):
    world, results = many_gpus
    for (s, kind), r in results[0].items():
        check_device(r, world, (s, kind))
        if kind in ("fp32", "bf16"):
            check_against_cpu_reference(r, kind, (s, kind, world))
            for other in results[1:]:   # every rank ends with the same model
                assert param_rel(other[(s, kind)]["params"], r["params"]) == 0.0, (s, kind)


@needs_gpus(2)
def test_gpus_ledger_equals_theory_over_nccl(many_gpus):
    world, results = many_gpus
    for (s, kind), r in results[0].items():
        if kind not in ("fp32", "bf16"):
            continue
        want = theory.comm_bytes_per_step(sum(r["layout"]), world, s, kind, layout=r["layout"],
                                          persistent=r["persistent"] or None)
        got = {k: v for k, v in r["ledger"].items() if v}
        assert got == {k: v for k, v in want.items() if v}, (s, kind, got, want)


@needs_gpus(2)
def test_gpus_model_states_equal_theory_on_the_allocator(many_gpus):
    world, results = many_gpus
    for rank_result in results:
        for (s, kind), r in rank_result.items():
            if kind in ("fp32", "bf16"):
                check_model_states(r, world, s, kind, (s, kind, world))


@needs_gpus(2)
def test_gpus_offload_is_pinned(many_gpus):
    world, results = many_gpus
    for r in results:
        o = r[(3, "offload")]
        assert o["host_pinned"] and all(o["host_pinned"]) and o["offload_impls"] == ["cuda_side_stream"], o
        check_against_cpu_reference(o, "bf16", (3, "offload", world))


# -- the script, where there is no GPU -----------------------------------------------------------------------------

@pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU: scripts/gpu_check.sh runs these tests for real")
def test_gpu_check_script_refuses_to_pass_without_a_gpu(tmp_path):
    """Without a GPU the script stops after step 1, exit status 1, saying why and what to install: a GPU check
    that skipped everything must never read as passed."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PY": sys.executable, "ZEROEDU_GPU_CHECK_OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "0 GPU(s) visible" in out and "doctor gpus: ok: none visible" in out, out
    assert "gpu_check: FAIL: torch sees no GPU" in out and "pip install torch==" in out, out
    assert "== 2. GPU tests" not in out, out
