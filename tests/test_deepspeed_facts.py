"""What the course says DeepSpeed 0.19.8 does, checked against DeepSpeed itself: its config defaults (read from its
own pydantic models), its code paths (read from its source files, quick: no ranks, no engine) and a run of real
DeepSpeed on 2 gloo ranks, next to zeroedu's `use_multi_rank_bucket_allreduce` on the same model (issue 29).

The closed forms are the ring volumes, written here in 16-bit or 32-bit ELEMENTS of the padded buckets: an
all-reduce sends 2 (N-1)/N of its buffer, a reduce-scatter or an all-gather (N-1)/N. So a stage 1-2 step sends
2 (N-1)/N Psi elements by the paper (reduce-scatter + all-gather) and 3 (N-1)/N Psi by DeepSpeed's default
(all-reduce + all-gather).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import zeroedu
from zeroedu.config import load_config

from reference import rel, single_process

pytestmark = pytest.mark.timeout(600)
N = 2


def test_deepspeed_defaults_the_course_quotes():
    """Each default the notebooks quote, read from DeepSpeed's own config models."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    z = DeepSpeedZeroConfig()
    # Fact 1: stages 1-2 all-reduce every gradient bucket by default (3 Psi elements a step, not 2 Psi).
    assert z.use_multi_rank_bucket_allreduce is True and z.reduce_scatter is True
    # Fact 8: the bucket caps are 5e8 elements, not 5e7 (5e7 is stage 3's prefetch bucket).
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.prefetch_bucket_size == 50_000_000 and z.max_live_parameters == 1_000_000_000
    # Fact 1's ZeRO-3 half: the reuse distance is 1e9 elements, so a small model is gathered once a step.
    assert z.max_reuse_distance == 1_000_000_000 and z.param_persistence_threshold == 100_000
    # Fact 3: the global gradient norm is computed (an all-reduce of a scalar) unless switched off.
    assert z.compute_grad_norm is True and DeepSpeedBF16Config().check_grad_overflow is True
    # Fact 7 and item 11: overlap_comm is on at stage 3 only; sub_group_size 1e9; round_robin_gradients off.
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert z.sub_group_size == 1_000_000_000 and z.round_robin_gradients is False
    # A tiny saved model at stage 3: the 16-bit weights are not gathered on save unless asked.
    assert z.gather_16bit_weights_on_model_save is False


# -- more of what notebooks 15 and 16 say about DeepSpeed 0.19.8, read from its config models and its source ---------
# Each test below imports DeepSpeed (once per session) and reads a default or a code path: no ranks, no engine.
def _src(obj, name: str | None = None) -> str:
    """The source of `obj`; with `name`, of the function or method `name` defined in module or class `obj` (read
    from the file: DeepSpeed wraps some methods in decorators that hide their source)."""
    import inspect
    import re

    text = inspect.getsource(obj)
    if name is None:
        return text
    m = re.search(rf"^( *)def {re.escape(name)}\(.*?(?=^\1(?:def |@|class )|\Z)", text, re.M | re.S)
    assert m, f"{name} is not defined in {obj}"
    return m.group(0)


def _in_order(text: str, *parts: str) -> bool:
    """Every part occurs in `text`, each after the one before."""
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


def test_gradient_clipping_is_one_when_the_key_is_left_out():
    """15 §3.9, 16's 'dsdefaults' card: DeepSpeed clips at 1.0 unless the config says otherwise; zeroedu's own
    default is 0 (initialize prints a note when the key is left out)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import constants
    from deepspeed.runtime.config import get_gradient_clipping

    assert constants.GRADIENT_CLIPPING_DEFAULT == 1.0 and get_gradient_clipping({}) == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0}) == 0
    assert load_config({}).gradient_clipping == 0


def test_fp16_dynamic_loss_scaling_skips_then_halves(monkeypatch):
    """15 §3.1: "loss_scale": 0 is the dynamic scaler, starting at 2^16 and doubling after 1,000 clean steps; with the
    default hysteresis of 2 the first overflow only skips the step, the second halves the scale."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    fp16 = DeepSpeedFP16Config()
    assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
            fp16.consecutive_hysteresis) == (0, 16, 1000, 2, False)
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *args, **kw: 0)   # it logs on rank 0 only
    scaler = loss_scaler.DynamicLossScaler(**fp16.dynamic_loss_scale_args())
    scales = [scaler.cur_scale]
    for overflow in (True, True):
        scaler.update_scale(overflow)
        scales.append(scaler.cur_scale)
    assert scales == [2**16, 2**16, 2**15]
    for _ in range(1000):
        scaler.update_scale(False)
    assert scaler.cur_scale == 2**15
    scaler.update_scale(False)
    assert scaler.cur_scale == 2**16                  # doubled once 1,000 steps have passed without an overflow


def test_grad_accum_dtype_is_the_models_unless_set_and_bf16_stage_1_fp32_takes_the_bf16_optimizer(monkeypatch):
    """15 §3.7: engine.get_data_types() accumulates in the model's dtype when data_types.grad_accum_dtype is left out;
    bf16 at stage 1 with fp32 accumulation (no offload) runs DeepSpeed's BF16_Optimizer, stage 2 its ZeRO optimizer."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.constants import BFLOAT16, GRAD_ACCUM_DTYPE_DEFAULT
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    def fake(accum: str | None, stage: int) -> SimpleNamespace:
        e = SimpleNamespace(fp16_enabled=lambda: False, bfloat16_enabled=lambda: True,
                            _config=SimpleNamespace(grad_accum_dtype=accum), zero_optimization=lambda: stage > 0,
                            zero_optimization_stage=lambda: stage, zero_cpu_offload=lambda: False,
                            zero_compute_grad_norm=lambda: True, zero_allow_untested_optimizer=lambda: False,
                            pipeline_parallelism=False)
        e.get_data_types = lambda: ds_engine.DeepSpeedEngine.get_data_types(e)
        return e

    assert GRAD_ACCUM_DTYPE_DEFAULT is None
    assert fake(None, 2).get_data_types() == (torch.bfloat16, torch.bfloat16)
    assert fake("fp32", 2).get_data_types() == (torch.bfloat16, torch.float32)
    monkeypatch.setattr(ds_engine, "is_zero_supported_optimizer", lambda optimizer: True)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    check = ds_engine.DeepSpeedEngine._do_optimizer_sanity_check
    assert check(fake("fp32", 1), adam) == BFLOAT16
    assert check(fake(None, 1), adam) == check(fake("fp32", 2), adam) == ZERO_OPTIMIZATION
    # BF16_Optimizer keeps a whole (unsharded) fp32 gradient buffer: the 20-byte case at N = 1
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    assert "torch.zeros_like(self.bf16_groups_flat[i], dtype=self.grad_acc_dtype)" in _src(BF16_Optimizer)


def test_stage_0_all_reduces_after_the_backward_in_5e8_element_buffers():
    """15 §3.9: without ZeRO the engine all-reduces the gradients once the backward is over, at the accumulation
    boundary, in 5e8-element buffers; overlap_comm plays no part. Stage 1 also communicates at the boundary only,
    stage 2 at every micro-step (15 A.4)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import engine as ds_engine

    Engine = ds_engine.DeepSpeedEngine
    assert ds_engine.MEMORY_OPT_ALLREDUCE_SIZE == 500_000_000
    allreduce = _src(Engine, "allreduce_gradients")
    assert allreduce.startswith("    def allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE):")
    assert _in_order(allreduce, "if self.zero_optimization_partition_gradients():",
                     "overlapping_partition_gradients_reduce_epilogue()",
                     "elif self.is_gradient_accumulation_boundary():", "self.optimizer.reduce_gradients(",
                     "self.buffered_allreduce_fallback(grads=grads, elements_per_buffer=bucket_size)")
    assert "self.allreduce_gradients()" in _src(Engine, "_backward_epilogue")
    assert "overlap" not in _src(Engine, "buffered_allreduce_fallback")


def test_stages_1_and_2_all_reduce_each_bucket_and_stage_3_reduce_scatters():
    """15 §3.9 (fact 1): average_tensor all-reduces the bucket when reduce_scatter is false, and with it true (the
    default) all-reduces it anyway while use_multi_rank_bucket_allreduce is true (the default); only with the key false
    does each slice go to its owner by dist.reduce. Stage 3's gradients are reduce-scattered whatever the key."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    avg = _src(Zero, "average_tensor")
    assert _in_order(avg, "if not self.reduce_scatter:", "self.gradient_reduction_w_predivide(")
    assert _in_order(avg, "if self.use_multi_rank_bucket_allreduce or len(copy_ranks) > 1:",
                     'bucket_key = ("allreduce", process_group)', "else:",
                     'bucket_key = ("reduce", dst, process_group)')
    assert _in_order(avg, "self.allreduce_and_scatter(", "self.allreduce_no_retain(", "rank=dst")
    assert "dist.all_reduce(" in _src(Zero, "gradient_reduction_w_predivide")
    assert _in_order(_src(Zero, "allreduce_bucket"), "if rank is None:", "dist.all_reduce(", "else:", "dist.reduce(")
    assert "self.allreduce_bucket(" in _src(Zero, "allreduce_and_copy_with_multiple_ranks")   # rank None: all-reduce
    assert "use_multi_rank_bucket_allreduce" not in _src(stage3)
    assert "reduce_scatter_coalesced(full_grads_for_rank" in _src(stage3)


def test_stages_1_and_2_allocate_the_whole_bucket_whatever_the_model():
    """15 A.2 (fact 4): both stages allocate reduce_bucket_size elements (5e8 by default: 1 GB in bf16) when the
    backward starts, a second such buffer with overlap_comm, in the model's dtype unless stage 1 accumulates in
    another."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    setup = _src(Zero, "setup_buckets")
    assert _in_order(setup, "if self.contiguous_gradients:", "torch.empty(int(self.reduce_bucket_size),",
                     "if self.overlap_comm:", "torch.empty(int(self.reduce_bucket_size),")
    assert "partition_gradients" not in setup                  # the same at stage 1 and stage 2
    assert "self.setup_buckets()" in _src(Zero, "process_gradients")
    assert "self.gradient_accumulation_dtype if self.use_grad_accum_attribute else self.dtype" in \
        _src(Zero, "_gradient_reduction_buffer_dtype")


def test_offload_copies_fp32_gradients_down_and_16_bit_parameters_up():
    """15 §3.4 (fact 6): the gradient shard is cast to fp32 on the device before the copy to the host (4 bytes a
    parameter), the updated shard is cast to 16 bits on the host and copied back (2 bytes): 6 Psi/N per step; the
    16-bit staging copy lives on the host."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    assert _in_order(_src(Zero, "async_inplace_copy_grad_to_fp32_buffer_from_gpu"),
                     "src_tensor = src_tensor.to(self.master_weights_and_grads_dtype)", "dest_tensor.copy_(src_tensor")
    assert _in_order(_src(Zero, "step"), "if self.cpu_offload:", "self._optimizer_step(i)",
                     "bit16_partition_buffer.data.copy_(fp32_partition.data)",
                     "bit16_partitions[partition_id].data.copy_(bit16_partition_buffer.data, non_blocking=True)")
    init = _src(Zero, "__init__")
    assert "self.device = get_accelerator().current_device_name() if not self.cpu_offload else 'cpu'" in init
    assert _in_order(init, "temp_buffer_bit16 = torch.full(weights_partition.shape",
                     "device=weights_partition.device)", "self.param_buffer_of_bit16_for_cpu_offload_groups.append(")


def test_no_delayed_parameter_update_only_opt_in_overlap():
    """15 §3.4 (fact 5): plain offload_optimizer has no delayed update; ZenFlow and SuperOffload, which overlap part of
    the CPU step, are off unless configured."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    offload = DeepSpeedZeroOffloadOptimizerConfig(device="cpu")
    assert not [k for k in DeepSpeedZeroOffloadOptimizerConfig.model_fields if "delay" in k or "dpu" in k]
    assert offload.super_offload is False and offload.ratio == 1.0
    assert DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": "cpu"}).zenflow is None
    assert ZenFlowConfig().overlap_step is False


def test_one_bit_optimizers_and_mics_are_gone():
    """15 A.4 #23 and §3.2, 16's MiCS card: DeepSpeed 0.19.8 has no 1-bit Adam, 0/1 Adam or 1-bit LAMB (PR #8490) and
    rejects the MiCS keys; ZeRO++'s hpZ key remains (default 1: off)."""
    pytest.importorskip("deepspeed")
    import importlib.util

    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert not [o for o in ds_config.DEEPSPEED_OPTIMIZERS if "bit" in o or "zero_one" in o]
    assert importlib.util.find_spec("deepspeed.runtime.fp16.onebit") is None
    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        with pytest.raises(ds_config.DeepSpeedConfigError, match="MiCS"):
            ds_config._reject_removed_config_keys({"zero_optimization": {key: 8}})
    assert DeepSpeedZeroConfig().zero_hpz_partition_size == 1


def test_pipeline_engine_takes_zero_0_and_1_only():
    """15 §3.6 and A.4 #24: DeepSpeed's PipelineEngine asserts the stage is below 2."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert _in_order(_src(PipelineEngine, "__init__"), "assert self.zero_optimization_stage(",
                     ") < ZeroStageEnum.gradients", "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism")


def test_stage_3_keeps_what_it_reuses_soon_once_the_trace_is_recorded():
    """15 §2 and §3.9: a parameter is not released while its next use lies within stage3_max_reuse_distance elements
    of the recorded module order; before the first trace is complete everything is released."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    release = _src(Coordinator, "__params_to_release")
    assert _in_order(release, "if not self.is_complete_trace():", "for module in self.__submodule_order[step_id:]:",
                     "if params_traversed >= self.__max_reuse_dist_in_numel:", "params_to_release.discard(param.ds_id)")
    assert "self.__params_to_release(submodule, self.__step_id) if self.is_complete_trace()" in \
        _src(Coordinator, "release_sub_module")


def test_the_rest_of_what_15_and_16_quote():
    """The 16-bit weights of a ZeRO-3 model are saved only when gathered (16's 'hf' card); ZeRO-3's elastic checkpoint
    is deprecated (15 A.7); sub_group_size is stage 3's (15 §3.9); the optimizer states are fp32 unless
    bf16.bf16_optimizer_states (15 A.2 #1); qwZ quantizes to 8 bits and qgZ to 4 (15 A.6 #31)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.zero import config as zero_config
    from deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2

    assert _in_order(_src(DeepSpeedEngine, "save_16bit_model"), "if self.zero_gather_16bit_weights_on_model_save():",
                     "else:", "because stage3_gather_16bit_weights_on_model_save is False", "return False")
    assert "ZeRO-3 elastic checkpointing is deprecated and no longer supported" in \
        _src(zero_config.DeepSpeedZeroConfig.elastic_checkpoint_deprecated)
    assert "sub_group_size" not in _src(stage_1_and_2) and "self.sub_group_size" in _src(stage3)
    assert DeepSpeedBF16Config().bf16_optimizer_states is False
    assert "swizzle_quant(tensor, intra_quant_group, 4," in _src(coalesced_collectives, "all_to_all_quant_reduce")
    assert "quantize(param, groups, 8," in _src(partition_parameters)


def test_zeroedu_reads_the_key_and_keeps_the_papers_default():
    zc = load_config({"zero_optimization": {"stage": 2}}).zero_optimization
    assert zc.use_multi_rank_bucket_allreduce is False
    on = load_config({"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": True}})
    assert on.zero_optimization.use_multi_rank_bucket_allreduce is True
    with pytest.raises(zeroedu.config.ConfigError, match="use_multi_rank_bucket_allreduce"):
        load_config({"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": "yes"}})


def _cfg(stage: int, allreduce: bool, precision: str = "fp32", accum: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 8 // (N * accum), "gradient_accumulation_steps": accum,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                  "use_multi_rank_bucket_allreduce": allreduce, **zero}}


def _zeroedu_runs(rank: int, world: int) -> dict:
    from workers import train

    out = {}
    for stage in (1, 2):
        for allreduce in (False, True):
            for accum in (1, 2):
                r = train(rank, world, "gpt", _cfg(stage, allreduce, accum=accum), steps=3)
                out[stage, allreduce, accum] = {"losses": r["losses"], "ledger": r["ledger"][1],
                                                "layout": r["layout"], "params": r["params"]}
    # Stage 3 has no such key in DeepSpeed: the same bytes with it on.
    for allreduce in (False, True):
        out[3, allreduce, 1] = {"ledger": train(rank, world, "gpt", _cfg(3, allreduce), steps=2)["ledger"][1]}
    return out


@pytest.fixture(scope="module")
def ours():
    return zeroedu.launch(_zeroedu_runs, world_size=N, timeout=550)[0]


def _padded(numel: int) -> int:
    return -(-numel // N) * N


def test_bytes_are_the_closed_form_for_both_settings(ours):
    """fp32 (4 bytes an element). Key false: the paper's reduce-scatter; true: an all-reduce of each bucket. Stage
    2 reduces every micro-step, stage 1 once a step; the parameter all-gather is the same either way."""
    for (stage, allreduce, accum), r in ours.items():
        if stage == 3:
            continue
        psi = sum(_padded(k) for k in r["layout"])   # elements, padded to N per bucket
        ledger, times = r["ledger"], accum if stage == 2 else 1
        grads = Fraction(2 if allreduce else 1) * (N - 1) / N * 4 * psi * times
        op = "backward/all_reduce" if allreduce else "backward/reduce_scatter"
        assert ledger.get(op) == grads, (stage, allreduce, accum, ledger)
        assert ledger.get("backward/reduce_scatter" if allreduce else "backward/all_reduce", 0) == 0
        assert ledger["step/all_gather"] == Fraction(N - 1, N) * 4 * psi
        if accum == 1:   # a step: 3 (N-1)/N Psi elements with the key, 2 (N-1)/N Psi without
            total = sum(v for k, v in ledger.items() if k != "total")
            assert total == Fraction(3 if allreduce else 2) * (N - 1) / N * 4 * psi


def test_same_training_either_way_and_as_one_process(ours):
    ref_losses, _ = single_process("gpt", steps=3)
    for (stage, allreduce, accum), r in ours.items():
        if stage == 3:
            continue
        assert rel(r["losses"], ref_losses) < 1e-6, (stage, allreduce, accum)
        # An all-reduce then a slice and a reduce-scatter give each rank the same sum of two numbers: bit-equal.
        other = ours[stage, not allreduce, accum]["params"]
        assert all(torch.equal(r["params"][k], other[k]) for k in other), (stage, accum)


def test_stage_three_ignores_the_key(ours):
    assert ours[3, True, 1]["ledger"] == ours[3, False, 1]["ledger"]
    assert "backward/all_reduce" not in ours[3, True, 1]["ledger"]


def _deepspeed_and_zeroedu(rank: int, world: int) -> dict:
    """The same TinyGPT, bf16, stage 2, under real DeepSpeed at its defaults (key true) and with the key false,
    and under zeroedu with the key true and false: bytes of each collective in step 1 (DeepSpeed's comms logger,
    zeroedu's ledger), and DeepSpeed's grad accumulation dtype."""
    from deepspeed.comm import comm as ds_comm

    from zeroedu.graduate import import_deepspeed
    from zeroedu.models import shard_batch

    from reference import batch, loss_fn, make

    ds = import_deepspeed()
    out: dict = {"psi": sum(p.numel() for p in make("gpt").parameters())}
    for allreduce in (True, False):
        cfg = _cfg(2, allreduce, "bf16")
        cfg["optimizer"]["params"]["torch_adam"] = True   # no FusedAdam build on CPU
        cfg["zero_optimization"]["reduce_bucket_size"] = 500_000_000   # DeepSpeed's default: one bucket here
        cfg["comms_logger"] = {"enabled": True}
        for name, lib in (("deepspeed", ds), ("zeroedu", zeroedu)):
            engine, *_ = lib.initialize(model=make("gpt"), config=cfg)
            if name == "deepspeed":
                out["data_types"] = [str(t) for t in engine.get_data_types()]
            for s in range(2):
                ds_comm.comms_logger.comms_dict.clear()
                x, y = batch("gpt", s, 8)
                xs, ys = shard_batch(x, y, rank, world)
                engine.backward(loss_fn(engine(xs), ys))
                engine.step()
            if name == "deepspeed":
                out[name, allreduce] = {op: sum(int(size) * int(v[0]) for size, v in sizes.items() if int(size) > 64)
                                        for op, sizes in ds_comm.comms_logger.comms_dict.items()}
            else:
                sums: dict[str, int] = {}
                for e in engine.ledger.select(step=1):
                    if e.tensor_bytes > 64:
                        sums[e.op] = sums.get(e.op, 0) + e.tensor_bytes
                out[name, allreduce] = sums
    return out


def test_deepspeed_at_its_default_all_reduces_the_gradients_as_zeroedu_with_the_key():
    """bf16, 2 bytes an element. DeepSpeed at its defaults: an all-reduce of the whole gradient (Psi elements,
    sent twice over by the ring: 3 Psi a step with the all-gather), no reduce-scatter; with the key false: a
    reduce of each rank's part to its owner. zeroedu with the key: the same all-reduce, to within padding; and
    DeepSpeed accumulates bf16 gradients in bf16 unless data_types.grad_accum_dtype says otherwise (fact 2)."""
    pytest.importorskip("deepspeed")
    r = zeroedu.launch(_deepspeed_and_zeroedu, world_size=N, timeout=550)[0]
    psi, pad = r["psi"], 2 * 64 * N   # each library pads its flat buffers a little (zeroedu to N, DeepSpeed to 2N)
    theirs, mine = r["deepspeed", True], r["zeroedu", True]
    assert 0 <= theirs["all_reduce"] - 2 * psi <= pad, theirs
    assert 0 <= mine["all_reduce"] - 2 * psi <= pad, mine
    assert theirs.get("reduce_scatter", 0) == theirs.get("reduce", 0) == 0
    assert "reduce_scatter" not in mine
    paper, theirs_off = r["zeroedu", False], r["deepspeed", False]
    assert paper.get("all_reduce", 0) == 0 and 0 <= paper["reduce_scatter"] - 2 * psi <= pad
    # DeepSpeed with the key false reduces each rank's slice to its owner (torch.distributed.reduce): Psi
    # elements in all, the bytes of the paper's reduce-scatter, and no gradient all-reduce.
    assert theirs_off.get("all_reduce", 0) == 0 and 0 <= theirs_off["reduce"] - 2 * psi <= pad, theirs_off
    # The parameter all-gather, the same in all four: DeepSpeed's logger counts this rank's input, zeroedu the
    # gathered output (N times as much).
    for off in (True, False):
        assert r["zeroedu", off]["all_gather"] == N * r["deepspeed", off]["all_gather_into_tensor"]
    assert r["data_types"] == ["torch.bfloat16", "torch.bfloat16"]


def test_the_audited_estimates_are_deepspeeds_own_formulas():
    """Notebook 18 quotes DeepSpeed's estimators as 2 + 18/N (stage 2) and 4 x largest layer + 18/N (stage 3) bytes
    per parameter on the GPU without offload: called here on round numbers, next to those closed forms."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from zeroedu.course.estimators import estimates

    psi, largest, n = 7_000_000_000, 500_000_000, 8
    assert estimate_zero2_model_states_mem_needs(psi, n, cpu_offload=False)[1] == 2 * psi + 18 * psi // n
    assert estimate_zero3_model_states_mem_needs(psi, largest, n, cpu_offload=False,
                                                 cpu_offload_params=False)[1] == 4 * largest + 18 * psi // n
    est = estimates(psi, largest, n)
    assert (est.deepspeed.stage2, est.deepspeed.stage3) == (2 * psi + 18 * psi // n, 4 * largest + 18 * psi // n)
    assert est.deepspeed.name == "DeepSpeed estimate_zero*_model_states_mem_needs"
    assert est.sixteen_per_param.stage2 == 16 * psi
    assert est.paper.stage3 == pytest.approx(16 * psi / n)


def test_a_bf16_weight_without_master_loses_updates_below_half_its_spacing():
    """Casebook case 10: next to 1.0, bf16's spacing below is 2**-8, so an Adam update of about 1e-3 (below half of
    it) rounds back to 1.0 at every step; through an fp32 master two updates add up past 2**-9 and the copy moves
    to 1 - 2**-8."""
    from zeroedu.course.casebook import masters_and_lr

    moves = masters_and_lr(steps=3, lr=1e-3)
    assert moves[False] == [1.0, 1.0, 1.0]
    assert moves[True][0] == 1.0 and moves[True][1] == 1 - 2 ** -8
