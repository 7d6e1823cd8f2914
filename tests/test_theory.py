"""zeroedu.theory against the papers' numbers, a ring simulated here, and bytes derived by hand in each test."""

from __future__ import annotations

import random

import pytest

from zeroedu import theory

pytestmark = pytest.mark.timeout(60)


# -- model states -------------------------------------------------------------------------------------------
def test_zero_paper_figure_1():
    """Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, K = 12 -> 120, 31.4, 16.6, 1.9 GB."""
    paper = [theory.model_state_bytes_paper(7.5e9, 64, s) / theory.GB for s in range(4)]
    assert [round(x, 1) for x in paper] == [120.0, 31.4, 16.6, 1.9]
    # 7.5e9 is a multiple of 64: the padded, exact form gives the same bytes.
    exact = [theory.model_state_bytes(7_500_000_000, 64, s, "bf16")["total"] for s in range(4)]
    assert exact == [pytest.approx(x * theory.GB) for x in paper]
    parts = theory.model_state_bytes_paper_parts(7.5e9, 64, 2)
    assert parts == {"parameters": 15e9, "gradients": 7.5e9 * 2 / 64, "optimizer_states": 12 * 7.5e9 / 64,
                     "total": pytest.approx(16.640625e9)}


def test_padding_odd_psi_three_ranks():
    # psi = 1001 on N = 3: one bucket pads to 1002, shard 334.
    assert theory.padded_numel(1001, 3) == 1002
    one = theory.model_state_bytes(1001, 3, 3, "bf16")
    assert one == {"parameters": 668, "gradients": 668, "master_weights": 1336, "optimizer_state": 2672,
                   "total": 5344}
    # Three buckets 333 + 334 + 334 pad to 333 + 336 + 336 = 1005 (each bucket separately), shard 335.
    layout = [333, 334, 334]
    assert theory.layout_numel(layout, 3) == 1005
    by_stage = [theory.model_state_bytes(1001, 3, s, "fp16", layout=layout) for s in range(4)]
    assert by_stage[0] == {"parameters": 2010, "gradients": 2010, "master_weights": 4020, "optimizer_state": 8040,
                           "total": 16080}
    assert by_stage[1] == {"parameters": 2010, "gradients": 2010, "master_weights": 1340, "optimizer_state": 2680,
                           "total": 8040}
    assert by_stage[2]["gradients"] == 670 and by_stage[2]["total"] == 2010 + 670 + 1340 + 2680
    assert by_stage[3]["total"] == 16 * 335
    # fp32: no separate master; SGD without momentum keeps no state.
    assert theory.model_state_bytes(1001, 3, 1, "fp32", "sgd", layout=layout) == {
        "parameters": 4020, "gradients": 4020, "master_weights": 0, "optimizer_state": 0, "total": 8040}


def test_bytes_per_parameter_and_errors():
    assert [theory.param_bytes(p) for p in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    assert [theory.master_bytes(p) for p in ("fp32", "bf16", "fp16")] == [0, 4, 4]
    assert theory.optimizer_state_bytes("AdamW") == 8 and theory.optimizer_state_bytes("sgd", momentum=0.9) == 4
    assert theory.optimizer_K("bf16") == 12 and theory.optimizer_K("fp32") == 8
    with pytest.raises(ValueError, match="precision must be one of"):
        theory.param_bytes("int8")
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        theory.model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="layout sums to 9"):
        theory.model_state_bytes(10, 2, 1, layout=[4, 5])


# -- ring bytes, against a ring simulated here ----------------------------------------------------------------
def simulate_ring(op: str, n: int, elems: int) -> tuple[list[int], list[list[float]]]:
    """Run a ring collective on Python lists, counting the elements each rank sends. Returns (sent, results)."""
    data = [[float(r * 100 + i) for i in range(elems)] for r in range(n)]
    c = elems // n
    chunk = lambda buf, k: buf[(k % n) * c: (k % n) * c + c]
    sent = [0] * n
    if op in ("reduce_scatter", "all_reduce"):
        acc = [list(d) for d in data]
        for s in range(n - 1):   # rank r sends its partial chunk (r - s - 1) to r + 1, which adds its own
            msgs = [chunk(acc[r], r - s - 1) for r in range(n)]
            for r in range(n):
                sent[r] += len(msgs[r])
                k = (r - 1 - s - 1) % n
                incoming = msgs[(r - 1) % n]
                acc[r][k * c: k * c + c] = [a + b for a, b in zip(acc[r][k * c: k * c + c], incoming, strict=True)]
        results = [chunk(acc[r], r) for r in range(n)]   # rank r ends holding the full sum of chunk r
        if op == "reduce_scatter":
            return sent, results
        data = [[0.0] * (r * c) + results[r] + [0.0] * (elems - r * c - c) for r in range(n)]
    full = [list(d) for d in data]          # all-gather: rank r starts with chunk r
    for s in range(n - 1):
        msgs = [chunk(full[r], r - s) for r in range(n)]
        for r in range(n):
            sent[r] += len(msgs[r])
            k = (r - 1 - s) % n
            full[r][k * c: k * c + c] = msgs[(r - 1) % n]
    return sent, full


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_ring_sent_bytes_equal_a_simulated_ring(op, n):
    elems, itemsize = 12 * n, 2
    sent, results = simulate_ring(op, n, elems)
    for r in range(n):
        assert sent[r] * itemsize == theory.ring_sent_bytes(op, elems * itemsize, n)
    # The simulation is a real collective: check its answer, so the byte count is of a correct algorithm.
    if op == "all_reduce":
        total = [sum(r * 100 + i for r in range(n)) for i in range(elems)]
        assert all(res == total for res in results)
    if op == "reduce_scatter":
        c = elems // n
        assert results[1 % n] == [sum(r * 100 + i for r in range(n)) for i in range((1 % n) * c, (1 % n) * c + c)]


def test_ring_formulas_and_steps():
    assert [theory.ring_sent_bytes("all_reduce", 1200, n) for n in (1, 2, 3, 4)] == [0, 1200, 1600, 1800]
    assert [theory.ring_sent_bytes("all_gather", 1200, n) for n in (1, 2, 3, 4)] == [0, 600, 800, 900]
    assert theory.ring_sent_bytes("reduce_scatter", 10, 3) == pytest.approx(20 / 3)   # unpadded: fractional
    assert theory.ring_steps("all_reduce", 4) == 6 and theory.ring_steps("all_gather", 4) == 3
    with pytest.raises(ValueError, match="op must be one of"):
        theory.ring_sent_bytes("gather", 10, 2)


# -- communication per step ---------------------------------------------------------------------------------
def test_comm_per_step_each_stage_and_accumulation():
    # psi = 10 on N = 3 in bf16: one bucket pads to 12 elements = 24 bytes; (N-1)/N of it is 16 bytes.
    c = lambda s, **kw: theory.comm_bytes_per_step(10, 3, s, "bf16", **kw)
    assert c(0) == c(0, grad_accum=4) == {"backward/all_reduce": 32, "total": 32}
    assert c(1, grad_accum=3) == {"backward/reduce_scatter": 16, "step/all_gather": 16, "total": 32}
    assert c(2, grad_accum=3) == {"backward/reduce_scatter": 48, "step/all_gather": 16, "total": 64}
    assert c(3, grad_accum=2) == {"forward/all_gather": 32, "backward/all_gather": 32,
                                  "backward/reduce_scatter": 32, "total": 96}
    # Stage 3 with units [4, 6], the 4-element one persistent; fp32 (4 bytes): both units pad to 6 = 24 bytes.
    p = theory.comm_bytes_per_step(10, 3, 3, "fp32", grad_accum=2, layout=[4, 6], persistent=[4])
    assert p == {"forward/all_gather": 2 * 16, "backward/all_gather": 2 * 16, "backward/reduce_scatter": 2 * 32,
                 "step/all_gather": 16, "total": 144}
    # One rank sends nothing.
    assert theory.comm_bytes_per_step(10, 1, 3, "bf16")["total"] == 0
    with pytest.raises(ValueError, match="persistent unit of 5 elements is not in the layout"):
        theory.comm_bytes_per_step(10, 3, 3, layout=[4, 6], persistent=[5])


def test_comm_per_step_tends_to_the_papers_units():
    """In units of psi compute-dtype elements, stages 0-2 move 2 psi and stage 3 moves 3 psi as N grows."""
    psi, n = 1_000_000 * 1024, 1024
    for s in range(4):
        units = theory.comm_bytes_per_step(psi, n, s, "fp16")["total"] / (2 * psi)
        assert units == pytest.approx(theory.comm_volume_paper(s) * (n - 1) / n)
    assert "reduce-scatter" in theory.comm_volume_paper.__doc__


# -- alpha-beta -------------------------------------------------------------------------------------------------
def test_collective_time_by_hand():
    # all_reduce of 4000 bytes on 4 ranks: 6 steps x 10 us + 6000 bytes / 1e9 B/s = 60 us + 6 us.
    assert theory.collective_time("all_reduce", 4000, 4, 10e-6, 1e9) == pytest.approx(66e-6)
    assert theory.collective_time("all_gather", 4000, 1, 10e-6, 1e9) == 0


def test_fit_recovers_alpha_beta():
    alpha, beta = 25e-6, 3e9
    sizes = [1 << k for k in range(8, 27, 3)]
    samples = [(op, s, n, theory.collective_time(op, s, n, alpha, beta))
               for op in ("all_reduce", "reduce_scatter", "all_gather") for s in sizes for n in (2, 3, 4)]
    a, b = theory.fit_alpha_beta(samples + [("all_reduce", 1 << 20, 1, 1e-3)])   # N = 1 is ignored
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    rng = random.Random(0)   # +-3% noise on every time: still within 10%
    noisy = [(op, s, n, t * (1 + rng.uniform(-0.03, 0.03))) for op, s, n, t in samples]
    a, b = theory.fit_alpha_beta(noisy)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.1)


def test_fit_errors_and_zero_latency():
    with pytest.raises(ValueError, match="at least two samples"):
        theory.fit_alpha_beta([("all_reduce", 100, 2, 1.0)])
    with pytest.raises(ValueError, match="several sizes"):
        theory.fit_alpha_beta([("all_reduce", 100, 2, 1.0), ("all_reduce", 100, 2, 1.1)])
    # Pure bandwidth (alpha = 0): the fit must not return a negative latency.
    samples = [("all_gather", s, 4, 0.75 * s / 1e9) for s in (1e3, 1e6, 1e9)]
    a, b = theory.fit_alpha_beta(samples)
    assert a >= 0 and b == pytest.approx(1e9, rel=1e-6)


# -- offload ------------------------------------------------------------------------------------------------
def test_offload_bytes_by_hand():
    # psi = 1000, N = 4, bf16: shard 250 elements.
    s2 = theory.offload_bytes(1000, 4, 2, "bf16", "cpu")
    assert s2["device"] == {"parameters": 2000, "gradients": 0, "master_weights": 0, "optimizer_state": 0,
                            "total": 2000}
    assert s2["host"] == {"parameters": 0, "gradients": 1000, "master_weights": 1000, "optimizer_state": 2000,
                          "total": 4000}
    assert s2["nvme"]["total"] == 0
    s1 = theory.offload_bytes(1000, 4, 1, "bf16", "cpu")
    assert s1["device"]["gradients"] == 2000          # stage 1 accumulates full gradients on the device
    s3 = theory.offload_bytes(1000, 4, 3, "bf16", "nvme", "cpu")
    assert s3["device"]["total"] == 0
    assert s3["host"] == {"parameters": 500, "gradients": 1000, "master_weights": 0, "optimizer_state": 0,
                          "total": 1500}
    assert s3["nvme"] == {"parameters": 0, "gradients": 0, "master_weights": 1000, "optimizer_state": 2000,
                          "total": 3000}
    # fp32 with the parameter shard on the optimizer's tier: that shard is the master, no second copy.
    f = theory.offload_bytes(1000, 4, 3, "fp32", "cpu", "cpu")
    assert f["host"] == {"parameters": 1000, "gradients": 1000, "master_weights": 0, "optimizer_state": 2000,
                         "total": 4000}
    assert theory.offload_bytes(1000, 4, 2, "fp32", "cpu")["host"]["master_weights"] == 1000
    # ... unless the master is kept separate, as DeepSpeed does: 4 x 250 on the optimizer's tier, or on the
    # device when only the parameters leave it.
    sep = theory.offload_bytes(1000, 4, 3, "fp32", "cpu", "cpu", separate_fp32_master=True)
    assert sep["host"]["master_weights"] == 1000 and sep["host"]["total"] == 5000
    dev = theory.offload_bytes(1000, 4, 3, "fp32", "none", "cpu", separate_fp32_master=True)
    assert dev["device"] == {"parameters": 0, "gradients": 1000, "master_weights": 1000, "optimizer_state": 2000,
                             "total": 4000}
    assert theory.offload_bytes(1000, 4, 3, "fp32", "none", "cpu")["device"]["master_weights"] == 0
    assert theory.offload_bytes(1000, 4, 2, "bf16", "cpu", host_grad_bytes=2)["host"]["gradients"] == 500
    # Nothing offloaded: the device holds model_state_bytes.
    assert theory.offload_bytes(1000, 4, 2)["device"] == theory.model_state_bytes(1000, 4, 2)
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        theory.offload_bytes(1000, 4, 0, "bf16", "cpu")
    with pytest.raises(ValueError, match="only at stage 3"):
        theory.offload_bytes(1000, 4, 2, "bf16", "cpu", "cpu")


def test_offload_transfers_by_hand():
    # psi = 1000, N = 4, bf16: shard 250 elements = 500 bytes in the compute dtype.
    t1 = theory.offload_transfer_bytes_per_step(1000, 4, 1, "bf16", "cpu", grad_accum=3)
    assert t1 == {"device_to_host/gradients": 500, "host_to_device/parameters": 500, "host_device": 1000,
                  "nvme": 0, "total": 1000}
    t2 = theory.offload_transfer_bytes_per_step(1000, 4, 2, "bf16", "cpu", grad_accum=3)
    assert t2["device_to_host/gradients"] == 1500     # reduced every micro-step
    t3 = theory.offload_transfer_bytes_per_step(1000, 4, 3, "bf16", "nvme", "nvme", grad_accum=2)
    assert t3 == {"device_to_host/gradients": 1000, "host_to_device/parameters": 2000,
                  "nvme_to_host/optimizer": 3000, "host_to_nvme/optimizer": 3000,   # (4 + 8) x 250 each way
                  "nvme_to_host/parameters": 2000, "host_to_nvme/parameters": 500,
                  "host_device": 3000, "nvme": 8500, "total": 11500}
    # fp32, everything on NVMe: the NVMe parameters are the master (8 x 250 each way), or not (12 x 250).
    f = lambda **kw: theory.offload_transfer_bytes_per_step(1000, 4, 3, "fp32", "nvme", "nvme", **kw)
    assert f()["nvme_to_host/optimizer"] == 2000 and f(separate_fp32_master=True)["nvme_to_host/optimizer"] == 3000
    tp = theory.offload_transfer_bytes_per_step(1000, 4, 3, "bf16", "none", "cpu")
    assert tp == {"host_to_device/parameters": 1000, "device_to_host/parameters": 500, "host_device": 1500,
                  "nvme": 0, "total": 1500}
    # hpZ: the backward gathers read the secondary copy on the device, so only the forward's shard crosses
    th = theory.offload_transfer_bytes_per_step(1000, 4, 3, "bf16", "cpu", "cpu", grad_accum=2, hpz=True)
    assert th["host_to_device/parameters"] == 1000 and th["device_to_host/gradients"] == 1000


def test_offload_nvme_buffers_by_hand():
    # Buckets of 10 and 6 elements on N = 4: pieces of 3 (10 pads to 12) and 2; every buffer holds the largest.
    b = theory.offload_nvme_buffer_bytes([10, 6], 4, "bf16", "nvme", "nvme", optimizer_buffer_count=2,
                                         param_buffer_count=5)
    assert b == {"parameters": 5 * 2 * 3, "master_weights": 2 * 4 * 3, "optimizer_state": 2 * 8 * 3, "total": 102}
    # Psi does not enter: a model with twice the buckets of the same size needs the same buffers.
    assert theory.offload_nvme_buffer_bytes([10, 6] * 2, 4, "bf16", "nvme", "nvme", 2, 5) == b
    assert theory.offload_nvme_buffer_bytes([10, 6], 4, "bf16", "cpu", "cpu")["total"] == 0


# -- ZeRO++ -------------------------------------------------------------------------------------------------
def test_quantized_bytes():
    assert theory.quantized_bytes(1000, 8, 256, 4) == 1000 + 4 * 4
    assert theory.quantized_bytes(1001, 4, 256, 4) == 501 + 4 * 4    # two codes a byte, rounded up


def test_zeropp_by_hand():
    """psi = 4096 fp16 on N = 4 ranks, 2 nodes of 2 (g = 2, M = 2), blocks of 64, 4-byte scales.
    A rank's piece is 1024 elements, its node slice 2048. Flat ring: M/N = 1/2 of the sends cross a node."""
    z = lambda **kw: theory.zeropp_comm_bytes(4096, 4, 2, block_size=64, scale_bytes=4, **kw)
    base = z()
    # Three rings of 3 x 1024 x 2 = 6144 bytes each, half across nodes.
    assert (base["intra_node"], base["cross_node"]) == (9216, 9216)
    assert base["cross_node_per_node"] == 18432 and base["hpz_secondary_bytes"] == 0
    # qwZ: a piece is 1024 int8 + 16 scales x 4 = 1088 bytes; both gathers, 3 x 1088 = 3264 each.
    q = z(qwz=True)
    assert (q["intra_node"], q["cross_node"]) == (3264 + 3072, 3264 + 3072)
    # hpZ: backward gathers 2048-element fp16 halves inside the node: 1 x 4096 bytes, all intra.
    h = z(hpz=True)
    assert (h["intra_node"], h["cross_node"]) == (3072 + 4096 + 3072, 3072 + 3072)
    assert h["hpz_secondary_bytes"] == 2 * 2048
    # qgZ: intra hop 1 x (2048 x 4 bits = 1024 + 32 scales x 4 = 128); inter hop 1 x (512 + 16 x 4 = 64).
    g = z(qgz=True)
    assert (g["intra_node"], g["cross_node"]) == (3072 + 3072 + 1152, 3072 + 3072 + 576)
    allz = z(qwz=True, hpz=True, qgz=True)
    assert (allz["intra_node"], allz["cross_node"]) == (1632 + 4096 + 1152, 1632 + 576)
    assert allz["total"] == 6880 + 2208
    assert [c["name"] for c in allz["collectives"]] == ["forward/all_gather", "backward/all_gather",
                                                        "backward/all_to_all"]
    # One node: nothing crosses.
    assert theory.zeropp_comm_bytes(4096, 4, 4, qgz=True)["cross_node"] == 0
    # Without ZeRO++, the bytes are stage 3's (same ring, same padding).
    assert base["total"] == theory.comm_bytes_per_step(4096, 4, 3, "fp16")["total"]
    with pytest.raises(ValueError, match="whole number of nodes"):
        theory.zeropp_comm_bytes(4096, 6, 4)


def test_zeropp_persistent_units_and_gradient_blocks_by_hand():
    """layout [4096, 64] fp16 on N = 4 in nodes of 2, the 64-element unit persistent. Pieces: 1024 and 16."""
    kw = dict(layout=[4096, 64], persistent=[64], precision="fp16", block_size=64)
    base = theory.zeropp_comm_bytes(4160, 4, 2, **kw)
    # Gathers move the big unit only (3 x 1024 x 2 = 6144 each); every unit's gradient is reduce-scattered
    # (3 x 1040 x 2 = 6240); the persistent unit is all-gathered once, after the step (3 x 16 x 2 = 96).
    assert [(c["name"], c["intra_node"] + c["cross_node"]) for c in base["collectives"]] == [
        ("forward/all_gather", 6144), ("backward/all_gather", 6144), ("backward/reduce_scatter", 6240),
        ("step/all_gather", 96)]
    assert base["total"] == theory.comm_bytes_per_step(4160, 4, 3, "fp16", layout=[4096, 64],
                                                       persistent=[64])["total"] == 18624
    # hpZ keeps no secondary copy of a unit that stays whole: 2 bytes x 4096 / 2
    assert theory.zeropp_comm_bytes(4160, 4, 2, hpz=True, **kw)["hpz_secondary_bytes"] == 4096
    # qgZ with gradient blocks of 32 (weights keep 64): node slices of 2048 and 32 elements, pieces 1024 and 16
    g = theory.zeropp_comm_bytes(4160, 4, 2, qgz=True, grad_block_size=32, **kw)["collectives"][2]
    assert (g["intra_node"], g["cross_node"]) == ((1024 + 64 * 4) + (16 + 4), (512 + 32 * 4) + (8 + 4))
    # twice the micro-steps: twice the gathers and reductions, the persistent gather still once a step
    two = theory.zeropp_comm_bytes(4160, 4, 2, grad_accum=2, **kw)
    assert two["total"] == 2 * (6144 + 6144 + 6240) + 96
    with pytest.raises(ValueError, match="grad_bits must be 4 or 8"):
        theory.zeropp_comm_bytes(4160, 4, 2, grad_bits=2, **kw)
    with pytest.raises(ValueError, match="not in the layout"):
        theory.zeropp_comm_bytes(4160, 4, 2, layout=[4096, 64], persistent=[65])


def test_zeropp_headline_3_to_0_75():
    assert theory.zeropp_volume_paper() == 3 and theory.zeropp_volume_paper(True, True, True) == 0.75
    # 1024 nodes of 8: what leaves a node per step, in units of 2 psi bytes, is near the paper's figures
    # (scales add 4 bytes a block: 0.2% on int8, 0.4% on int4, at blocks of 2048).
    psi = 2**33
    base = theory.zeropp_cross_node_ratio(psi, 8192, 8)
    full = theory.zeropp_cross_node_ratio(psi, 8192, 8, qwz=True, hpz=True, qgz=True)
    assert base == pytest.approx(3.0, rel=1e-3) and full == pytest.approx(0.75, rel=5e-3)
    assert base / full == pytest.approx(4, rel=5e-3)
