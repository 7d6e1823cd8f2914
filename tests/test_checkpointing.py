"""Activations (zeroedu.memory.SavedActivations) and activation checkpointing (zeroedu.checkpointing).

References, none taken from the code under test: the closed forms of zeroedu.theory (Korthikanti et al. 2022,
written out again below for the paper's numbers, and TinyGPT's block term by term); the same training without
checkpointing (bit for bit in fp32: recomputation reruns the same operations on the same inputs); a single
process computing the whole (not tensor-parallel) MLP; and the ring volume (t-1)/t x S of an all-gather.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from zero_r_workers import gpt_runs, tp_mlp_run

import zeroedu
from zeroedu import checkpointing, theory
from zeroedu.config import ConfigError, load_config
from zeroedu.memory import SavedActivations
from zeroedu.models import TensorParallelMLP, TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss

pytestmark = pytest.mark.timeout(300)
H, A, LAYERS = 64, 4, 2         # TinyGPT's default width, heads and depth


def test_korthikanti_closed_forms():
    """sbh(34 + 5as/h) per layer in 16-bit (GPT-3 175B's layer at s=2048, b=1: 34 x 2048 x 12288 bytes plus
    5 x 96 x 2048^2), 34sbh without the scores (flash), 2sbh with full recomputation."""
    s, b, h, a = 2048, 1, 12288, 96
    assert theory.korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert theory.korthikanti_layer_bytes(s, b, h, a) == 855_638_016 + 2_013_265_920
    assert theory.korthikanti_layer_bytes(s, b, h, a, flash_attention=True) == 855_638_016
    assert theory.korthikanti_layer_bytes(s, b, h, a, "full") == 2 * s * b * h
    # a model at full recomputation: every layer's input plus one layer's activations
    assert theory.activation_bytes(s, b, h, a, 96, "full") == 96 * 2 * s * b * h + 34 * s * b * h + 5 * a * s * s * b
    with pytest.raises(ValueError, match="'none' or 'full'"):
        theory.korthikanti_layer_bytes(s, b, h, a, "selective")


def test_tinygpt_layer_in_16bit_is_korthikanti_less_dropout():
    """Our block has no dropout: Korthikanti's 34sbh + 5as^2b less the two sbh masks and 3as^2b (the scores'
    mask and dropout output), plus what the CPU kernels add (LayerNorm statistics 8bs, the causal mask s^2)."""
    for s, b in [(8, 2), (32, 3), (128, 1)]:
        k = theory.korthikanti_layer_bytes(s, b, H, A)
        want = k - 2 * s * b * H - 3 * A * s * s * b + 8 * b * s + s * s
        assert theory.tinygpt_layer_bytes(s, b, H, A, "bf16") == want


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_activations_of_one_block_equal_the_formula(precision, fused):
    """The meter on a plain TinyGPT forward (no engine), several sequence lengths."""
    for s in (8, 16, 32):
        m = TinyGPT(TinyGPTConfig(fused_attention=fused)).to({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])
        with SavedActivations(m, [*m.parameters(), *m.buffers()]) as meter:
            m(torch.randint(0, 128, (3, s)))
        want = theory.tinygpt_layer_bytes(s, 3, H, A, precision, fused)
        assert [meter.under(f"blocks.{i}") for i in range(LAYERS)] == [want, want], (s, dict(meter.by_module))


def test_engine_meter_and_checkpointing_on_two_ranks():
    """Stages 0 and 3 on 2 gloo ranks, fp32: per-block activations equal the formula at s = 16 and 32 (stage 3's
    gathered weights are not activations); checkpointed, each block keeps its input (sbh x 4 bytes) and the
    losses and weights equal the run without checkpointing bit for bit, also with partitioned, CPU and
    contiguous checkpoints (whose host copies are in the ledger)."""
    full_ac = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": LAYERS, "synchronize_checkpoint_boundary": True, "profile": True}
    runs = []
    for stage in (0, 3):
        for s in (16, 32):
            runs.append((f"{stage}/{s}", dict(stage=stage, seq=s)))
            runs.append((f"{stage}/{s}/ck", dict(stage=stage, seq=s, model={"checkpoint_activations": True})))
        runs.append((f"{stage}/32/ck+", dict(stage=stage, ac=full_ac, model={"checkpoint_activations": True})))
    res = zeroedu.launch(gpt_runs, world_size=2, args=(runs,))
    b = 8 // 2
    for rank in range(2):
        r = res[rank]
        for stage in (0, 3):
            for s in (16, 32):
                plain, ck = r[f"{stage}/{s}"], r[f"{stage}/{s}/ck"]
                layer = theory.tinygpt_layer_bytes(s, b, H, A, "fp32")
                assert plain["blocks"] == [layer] * LAYERS
                kept = theory.tinygpt_layer_bytes(s, b, H, A, "fp32", checkpointed=True)
                assert ck["blocks"] == [kept] * LAYERS
                assert plain["activations"] - ck["activations"] == LAYERS * (layer - kept)
                assert ck["losses"] == plain["losses"]
                assert all(torch.equal(ck["params"][k], v) for k, v in plain["params"].items())
                assert ck["moved"] == [] and ck["stats"]["recomputes"] == ck["stats"]["checkpoints"]
            plus, plain = r[f"{stage}/32/ck+"], r[f"{stage}/32"]
            assert plus["losses"] == plain["losses"]
            assert all(torch.equal(plus["params"][k], v) for k, v in plain["params"].items())
            # On the host: no block keeps device activations; every step copies each checkpoint out and back.
            assert plus["blocks"] == [0] * LAYERS
            nbytes = 4 * 32 * b * H
            per_step = [("d2h", "forward", nbytes)] * LAYERS + [("h2d", "backward", nbytes)] * LAYERS
            assert plus["moved"] == per_step * 3
            st = plus["stats"]
            assert st["checkpoints"] == st["recomputes"] == 3 * LAYERS and st["host_bytes"] == 0
            assert st["host_bytes_peak"] == LAYERS * nbytes and st["synchronized"] == 4 * 3 * LAYERS
            assert len(st["forward_seconds"]) == len(st["recompute_seconds"]) == 3 * LAYERS


def test_partition_activations_over_tensor_parallel_ranks():
    """Three tensor-parallel MLP layers on 2 ranks, each checkpointed with partition_activations: each rank
    keeps half of every layer's input and the backward all-gathers it ((t-1)/t x S sent, in the ledger);
    loss and gradients equal the unpartitioned, uncheckpointed run bit for bit and the whole MLP on one process
    to rounding."""
    layers, d, tokens = 3, 16, 10            # 160 values per layer input: 80 per rank
    ac = {"partition_activations": True}
    ck = zeroedu.launch(tp_mlp_run, world_size=2, args=(layers, d, tokens, ac))
    plain = zeroedu.launch(tp_mlp_run, world_size=2, args=(layers, d, tokens, None))
    n = tokens * d
    for rank in range(2):
        a, b = ck[rank], plain[rank]
        assert a["loss"] == b["loss"] and torch.equal(a["x_grad"], b["x_grad"])
        assert all(torch.equal(g, h) for g, h in zip(a["grads"], b["grads"], strict=True))
        loss_saves = 2 * 4 * n                    # mse_loss keeps its input and target
        assert a["saved"] == layers * 4 * (n // 2) + loss_saves
        # without checkpointing a layer keeps its input (n) and its 4d/t-wide GELU input and output
        assert b["saved"] == layers * 4 * (n + 2 * 4 * n // 2) + loss_saves
        assert a["moved"] == [("all_gather", "backward", "activations", 4 * n, 4 * n // 2)] * layers
    # the whole MLP, built once from the same seeds, on one process
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(5)).requires_grad_()
    h = x
    for i in range(layers):
        fc, out = TensorParallelMLP.full(d, seed=i)
        h = h + out(F.gelu(fc(h)))
    loss = F.mse_loss(h, torch.zeros_like(h))
    loss.backward()
    assert ck[0]["loss"] == pytest.approx(float(loss.detach()), rel=1e-6)
    torch.testing.assert_close(ck[0]["x_grad"], x.grad, rtol=1e-5, atol=1e-7)


def test_checkpoint_without_grad_and_on_one_process():
    """No grad: fn runs as is. A tuple output and a non-tensor argument recompute correctly."""
    checkpointing.configure(None)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(checkpointing.checkpoint(lin, x), lin(x))

    def two(t, k):
        return lin(t) * k, torch.tanh(t)

    w = torch.randn(3, 4)                       # no input requires grad: lin's parameters still get theirs
    checkpointing.checkpoint(lin, w).sum().backward()
    gw = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(w).sum().backward()
    assert torch.equal(gw, lin.weight.grad)
    a, c = checkpointing.checkpoint(two, x, 3.0)
    (a.sum() + c.sum()).backward()
    g = x.grad.clone()
    x.grad = None
    a, c = two(x, 3.0)
    (a.sum() + c.sum()).backward()
    assert torch.equal(g, x.grad)


def test_tinygpt_checkpointed_on_one_process_is_bit_for_bit():
    checkpointing.configure(None)
    out = []
    for ck in (False, True):
        m = TinyGPT(TinyGPTConfig(checkpoint_activations=ck))
        loss = gpt_loss(m(gpt_batch(0, 4)[0]), gpt_batch(0, 4)[1])
        loss.backward()
        out.append((float(loss.detach()), [p.grad for p in m.parameters()]))
    assert out[0][0] == out[1][0] and all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))


def test_config_section_errors_name_the_fix():
    ok = load_config({"activation_checkpointing": {"partition_activations": True, "number_checkpoints": 4}})
    assert ok.activation_checkpointing.number_checkpoints == 4
    with pytest.raises(ConfigError, match="partition_activations"):
        load_config({"activation_checkpointing": {"cpu_checkpointing": True}})
    with pytest.raises(ConfigError, match="number_checkpoints"):
        load_config({"activation_checkpointing": {"partition_activations": True,
                                                  "contiguous_memory_optimization": True}})
    with pytest.raises(ConfigError, match="Did you mean 'activation_checkpointing.cpu_checkpointing'"):
        load_config({"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ConfigError, match="grad_accum_dtype"):
        load_config({"data_types": {"grad_accum_dtype": "fp64"}})


def test_too_many_checkpoints_for_the_contiguous_buffer():
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    m = TinyGPT(TinyGPTConfig(checkpoint_activations=True))
    with pytest.raises(RuntimeError, match="number_checkpoints is 1"):
        m(torch.randint(0, 128, (2, 8)))
    checkpointing.configure(None)
