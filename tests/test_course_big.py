"""Notebooks 11 and 12's harnesses (zeroedu.course_big) on real ranks, and what those notebooks rest on: TinyGPT
built inside zero.Init equals TinyGPT built whole, bytes per parameter in theory, the planner's frozen
parameters (LoRA), and the contiguous checkpoint buffer on its own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import zeroedu
from zeroedu import checkpointing, course_big, planner, theory
from zeroedu.memory import SavedActivations
from zeroedu.models import TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss

pytestmark = pytest.mark.timeout(300)


# -- TinyGPT's initialisation, whole and inside zero.Init ---------------------------------------------------------
def tinygpt_as_before(cfg: TinyGPTConfig | None = None, seed: int = 0) -> TinyGPT:
    """The reference: TinyGPT's weights drawn as its constructor drew them before it knew about zero.Init (the
    init loop on whole tensors), written out here so a change to models.py cannot move both sides."""
    cfg = cfg or TinyGPTConfig()
    m = TinyGPT.__new__(TinyGPT)
    nn.Module.__init__(m)
    m.cfg = cfg
    torch.manual_seed(seed)
    m.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
    m.wpe = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
    from zeroedu.models import Block

    m.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
    m.ln_f = nn.LayerNorm(cfg.d_model)
    m.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    m.head.weight = m.wte.weight
    for mod in m.modules():
        if isinstance(mod, nn.Linear | nn.Embedding):
            nn.init.normal_(mod.weight, std=0.02)
        if isinstance(mod, nn.Linear) and mod.bias is not None:
            nn.init.zeros_(mod.bias)
    return m


def test_tinygpt_built_normally_keeps_its_weights():
    for cfg, seed in ((None, 0), (TinyGPTConfig(n_layer=3, d_model=32), 7)):
        got, want = TinyGPT(cfg, seed=seed).state_dict(), tinygpt_as_before(cfg, seed).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert TinyGPT().wte.weight.std() < 0.03          # the 0.02 init, not nn.Embedding's N(0, 1)


def _tinygpt_inside_init(rank: int, world: int) -> dict:
    from zeroedu import zero

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zero.Init(config=cfg):
        model = TinyGPT()
    empty = [p.numel() for p in model.parameters()]
    with zero.GatheredParameters(list(model.parameters())):
        whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"empty": empty, "whole": whole, "wte_std": float(whole["wte.weight"].std())}


def test_tinygpt_inside_init_equals_tinygpt_built_whole():
    """Inside Init each module is partitioned when its constructor returns, so TinyGPT's init loop gathers one
    module at a time (GatheredParameters, modifier_rank=0) and writes the result back into the pieces: the
    model is the one built whole, bit for bit, on every rank (it used to keep nn.Embedding's N(0, 1) weights)."""
    res = zeroedu.launch(_tinygpt_inside_init, world_size=2)
    want = TinyGPT().state_dict()
    for r in res:
        assert set(r["empty"]) == {0}
        assert r["whole"].keys() == want.keys()
        assert all(torch.equal(r["whole"][k], v) for k, v in want.items()), r["wte_std"]


# -- notebook 11: C_B -------------------------------------------------------------------------------------------
def test_bucket_buffers_stay_constant_with_a_fixed_reduce_bucket_size():
    res = zeroedu.launch(course_big.bucket_bytes, world_size=2, args=((2, 4), 20_000))
    for r in res:
        (p2, n2, fixed2), (p4, n4, fixed4) = r[(2, "fixed")], r[(4, "fixed")]
        assert r[(2, "fixed")].bucket_elements == 20_000 and r[(2, "fixed")].bucket_bytes_high == fixed2
        assert n2 == n4 == 20_000 and p4 > p2
        assert fixed2 == fixed4 <= 20_000 * 4                   # one fp32 buffer of at most a bucket (no overlap)
        (_, d2, default2), (_, d4, default4) = r[(2, "default")], r[(4, "default")]
        assert d4 > d2 and default4 > default2                  # sized by the model: grows with it


def test_zero_r_names_its_results_as_notebook_11_reads_them():
    """zero_r returns a ZeroR: (a) P_a halves the 3 checkpoints' bytes on 2 ranks and all-gathers each before its
    recompute; (b) the ZeRO-R section moves block 0's checkpoint to the host, at most number_checkpoints of them."""
    n = 256 * 64 * 4                                    # one layer input, fp32 bytes
    r = zeroedu.launch(course_big.zero_r, world_size=2)[0]
    assert r.unpartitioned.kept_bytes - r.partitioned.kept_bytes == 3 * n // 2
    assert r.partitioned.gathers == [("all_gather", n // 2)] * 3 and r.unpartitioned.gathers == []
    assert r.stage3_plain.block0_bytes > 0 == r.stage3_zero_r.block0_bytes
    assert r.stage3_zero_r.stats["host_bytes_peak"] == 2 * 32 * 4 * 64 * 4
    assert {op for op, _ in r.stage3_zero_r.host_copies} == {"d2h", "h2d"} and r.stage3_plain.host_copies == []
    assert all(torch.equal(a, b) for a, b in zip(r.stage3_plain.losses, r.stage3_zero_r.losses, strict=True))


# -- notebook 12: FSDP2 next to zeroedu ---------------------------------------------------------------------------
def test_fsdp2_and_zeroedu_run_the_same_bytes():
    res = zeroedu.launch(course_big.fsdp2_side_by_side, world_size=2)
    for r in res:
        psi, units = r["psi"], r["units"]
        full, keep = r["FSDP2 reshard_after_forward=True"], r["FSDP2 reshard_after_forward=False"]
        s3, s2 = r["zeroedu stage 3"], r["zeroedu stage 2"]
        assert full["counts"] == s3["counts"] == {"all_gather": 6, "reduce_scatter": 3}
        # FSDP2 gathers each of its 3 groups in forward; stage 2 every bucket in one collective after the step
        assert keep["counts"] == {"all_gather": 3, "reduce_scatter": 3}
        assert s2["counts"] == {"all_gather": 1, "reduce_scatter": 3}
        assert full["sent"] == s3["sent"] == theory.comm_bytes_per_step(psi, 2, 3, "fp32", layout=units)["total"]
        assert keep["sent"] == s2["sent"] == theory.comm_bytes_per_step(psi, 2, 2, "fp32", layout=units)["total"]
        # Adam in fp32: FSDP2 frees its gradients after the step (zero_grad), zeroedu keeps its gradient shard;
        # stage 2 keeps the parameters whole.
        assert full["states"] == keep["states"] == 12 * psi // 2
        assert s3["states"] == 16 * psi // 2 and s2["states"] == 4 * psi + 12 * psi // 2
        # between forward and backward, reshard_after_forward=False still holds every gathered parameter
        assert keep["after_forward"] - full["after_forward"] >= 4 * psi // 2
        # zeroedu's stage 3 holds its gradient shard besides, still less than FSDP2 keeping its parameters (live
        # bytes move by a layer from run to run, with the comm thread: compare with margins, not to the byte)
        assert s3["after_forward"] < keep["after_forward"]


def test_hsdp_keeps_its_gathers_inside_a_node_and_hpz_its_backward_gather():
    res = course_big.node_traffic(zeroedu.launch(course_big.hsdp_vs_hpz, world_size=4), 2)
    hsdp, hpz, s3 = res["FSDP2 HSDP 2x2"], res["zeroedu hpZ"], res["zeroedu stage 3"]
    assert hsdp["counts"] == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 3}
    assert hpz["counts"] == s3["counts"] == {"all_gather": 6, "reduce_scatter": 3}
    psi = 6922
    # HSDP: only the all-reduce of each rank's half of the gradients crosses nodes (a ring of 2: S bytes sent)
    assert hsdp["cross_node"] == 4 * psi // 2
    assert hsdp["cross_node"] < hpz["cross_node"] < s3["cross_node"]
    assert hpz["total"] < s3["total"]


# -- bytes per parameter ------------------------------------------------------------------------------------------
def test_bytes_per_parameter_in_practice():
    per = theory.model_state_bytes_per_param
    assert per()["total"] == 16
    assert per(grad_accum_dtype="fp32")["total"] == 18
    assert per(grad_accum_dtype="fp32", keep_low_precision_grads=True)["total"] == 20
    assert per(optimizer_bits=8)["total"] == 10 + 8 / theory.ADAM8BIT_BLOCK
    assert per(optimizer_bits=16, master_weights=False)["total"] == 8
    assert per("fp32")["total"] == 16 and per("fp32")["master_weights"] == 0
    # sharded as the stages shard: stage 1 with fp32 accumulation on 2 ranks = 2 + 4 + 12 / 2
    assert per(grad_accum_dtype="fp32", world_size=2, stage=1)["total"] == 12
    assert per(world_size=4, stage=3)["total"] == 4
    with pytest.raises(ValueError, match="optimizer_bits"):
        per(optimizer_bits=4)


# -- the planner with frozen parameters ---------------------------------------------------------------------------
def test_planner_counts_optimizer_state_for_trainable_parameters_only():
    full, lora = planner.plan("7B", gpus=8), planner.plan("7B", gpus=8, trainable=20_000_000)
    psi = full.model.psi
    s0 = lora.row("stage 0")
    assert s0.device["parameters"] == 2 * psi                     # the frozen base, whole at stages 0-2
    assert s0.device["gradients"] == 2 * 20_000_000
    assert s0.device["master_weights"] + s0.device["optimizer_state"] == 12 * 20_000_000
    assert lora.row("stage 3").device["parameters"] == full.row("stage 3").device["parameters"]
    assert s0.comm_bytes < full.row("stage 0").comm_bytes / 100    # only the adapters' gradients travel
    assert lora.recommendation.label == "stage 0" and full.recommendation.label != "stage 0"
    assert planner.plan("7B", gpus=8, trainable=1.0).row("stage 0").total == full.row("stage 0").total
    assert math.isclose(planner.plan("7B", gpus=8, trainable=0.5).trainable, psi / 2, abs_tol=1)
    with pytest.raises(ValueError, match="trainable"):
        planner.plan("7B", trainable=0)


# -- the contiguous checkpoint buffer, on the device, alone ---------------------------------------------------------
def test_contiguous_checkpoint_buffer_on_the_device():
    """contiguous_memory_optimization without cpu_checkpointing: both blocks' checkpoints are slots of one
    buffer of number_checkpoints x (sbh) values on the device, made once; the gradients are those of plain
    checkpoints, bit for bit."""
    x, y = gpt_batch(0, 4)
    out = {}
    for contiguous in (False, True):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=contiguous,
                                num_checkpoints=2)
        model = TinyGPT(TinyGPTConfig(checkpoint_activations=True))
        with SavedActivations(model, [*model.parameters(), *model.buffers()]) as meter:
            loss = gpt_loss(model(x), y)
        buffers = dict(checkpointing._STATE.buffers)
        loss.backward()
        out[contiguous] = (meter.under("blocks"), buffers, [p.grad for p in model.parameters()], checkpointing.stats())
    checkpointing.configure(None)
    sbh = 4 * 32 * 64
    (plain, none, g0, _), (kept, bufs, g1, st1) = out[False], out[True]
    assert none == {} and list(bufs) == [(torch.float32, torch.device("cpu"))]
    assert tuple(bufs[(torch.float32, torch.device("cpu"))].shape) == (2, sbh)
    assert plain == kept == 2 * 4 * sbh                     # two checkpoints of sbh fp32 values, once each
    assert st1["host_bytes_peak"] == 0 and st1["recomputes"] == 2
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


def test_contiguous_device_buffer_trains_without_a_meter():
    """Each slot of the contiguous buffer is a tensor of its own over the buffer's storage, so filling one does
    not mark the others modified (views of one tensor share a version counter and backward refused them)."""
    x, y = gpt_batch(0, 2)
    plain = TinyGPT(TinyGPTConfig())
    gpt_loss(plain(x), y).backward()
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    try:
        model = TinyGPT(TinyGPTConfig(checkpoint_activations=True))
        gpt_loss(model(x), y).backward()
        assert checkpointing.stats()["recomputes"] == 2
    finally:
        checkpointing.configure(None)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name          # fp32: recomputation changes no bit


def test_forward_without_backward_then_reset():
    """A forward in grad mode whose backward never runs leaves its checkpoints' slots taken: the next forward
    finds the contiguous buffer full. checkpointing.reset() frees it, as DeepSpeed's
    deepspeed.checkpointing.reset() does (to be called when forwards run without backward, e.g. evaluation in
    grad mode); torch.no_grad() forwards take no checkpoint at all. Notebook 11 says so. (On the host, as notebook
    11 runs it: see the test above for the device buffer.)"""
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2,
                            checkpoint_in_cpu=True)
    model = TinyGPT(TinyGPTConfig(checkpoint_activations=True))
    x, y = gpt_batch(0, 2)
    model(x)                                   # no backward
    with pytest.raises(RuntimeError, match="number_checkpoints is 2"):
        model(x)
    checkpointing.reset()
    with torch.no_grad():
        model(x)                               # no checkpoint taken
    gpt_loss(model(x), y).backward()
    gpt_loss(model(x), y).backward()           # each backward frees its slots
    checkpointing.configure(None)
