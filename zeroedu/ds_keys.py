"""DeepSpeed's config keys that zeroedu knows and does not implement, each with what zeroedu says about it.

Every DeepSpeed key zeroedu knows falls in one of four groups: implemented (parsed by zeroedu.config), accepted
with a note (NOTED: it changes nothing here, and the note says why), accepted at DeepSpeed's default value only
(DEFAULT_ONLY), or refused with the reason (REFUSED). A key in none of them is a typo, answered with the closest
valid key (zeroedu.config). `classify` says which group a key that is not implemented falls in, and what to tell
the learner. "auto", the Hugging Face Trainer's placeholder, is answered with the value the Trainer would write
(`auto_problem`). Also here: DeepSpeed's optimizers that zeroedu does not implement, and its deprecated offload
keys.
"""

from __future__ import annotations

import json
from typing import Any

# Refused: real DeepSpeed settings outside what zeroedu implements, by section, with the reason.
_OUT_OF_SCOPE_PARALLEL = "model parallelism, outside ZeRO's data parallelism (the only parallelism zeroedu teaches)"
_NO_MONITOR = ("zeroedu has no monitor backends; engine.ledger, engine.memory() and engine.log_lines hold "
               "what they would record")
_RECIPE = "a training-recipe feature outside ZeRO"
REFUSED: dict[str, dict[str, str]] = {
    "": {
        "pipeline": "pipeline parallelism (DeepSpeed's PipelineModule) is " + _OUT_OF_SCOPE_PARALLEL,
        "tensor_parallel": "tensor parallelism (AutoTP) is " + _OUT_OF_SCOPE_PARALLEL,
        "sequence_parallel_size": "sequence parallelism (Ulysses) is " + _OUT_OF_SCOPE_PARALLEL,
        "moe": "mixture-of-experts layers and expert parallelism are " + _OUT_OF_SCOPE_PARALLEL,
        "compression_training": "model compression (quantization-aware training, pruning) is not part of ZeRO",
        "quantize_training": "quantization-aware training is not part of ZeRO",
        "weight_quantization": "weight quantization for inference is not part of ZeRO",
        "sparse_attention": "sparse attention kernels are " + _RECIPE,
        "data_efficiency": "data sampling and routing are " + _RECIPE,
        "curriculum_learning": "curriculum learning is " + _RECIPE,
        "progressive_layer_drop": "progressive layer dropping is " + _RECIPE,
        "eigenvalue": "eigenvalue-based layer scheduling is " + _RECIPE,
        "autotuning": ("the autotuner launches many experiments through DeepSpeed's launcher; `zeroedu plan` "
                       "reasons about the same choices from the formulas"),
        "elasticity": ("elastic training changes the batch with the world size; zeroedu's checkpoints reshard to "
                       "any world size instead (zeroedu.checkpoint)"),
        "flops_profiler": "zeroedu measures bytes, not FLOPs (torch.profiler counts FLOPs)",
        "tensorboard": _NO_MONITOR, "wandb": _NO_MONITOR, "csv_monitor": _NO_MONITOR, "comet": _NO_MONITOR,
        "amp": "NVIDIA Apex AMP is not used here: write 'bf16' or 'fp16' instead",
        "fp8": "fp8 training needs Transformer Engine on recent GPUs",
        "torch_autocast": "zeroedu casts the model to the compute dtype ('bf16'/'fp16') instead of autocasting",
        "checkpoint": ("DeepSpeed's checkpoint-engine options; zeroedu's checkpoints are always sharded, atomic "
                       "and resharding (zeroedu.checkpoint)"),
        "hybrid_engine": "the RLHF hybrid engine switches to inference kernels, outside ZeRO training",
        "compile": "torch.compile of the engine is not part of zeroedu",
        "nebula": "Nebula is Azure's asynchronous checkpoint service",
    },
    "zero_optimization": {
        "zenflow": ("ZenFlow (update the most important gradients on the device at once and the rest later on the "
                    "CPU) changes the optimizer's schedule; zeroedu steps every parameter at every step"),
        "mics_shard_size": "MiCS (sharding within sub-groups of ranks) is a different design from ZeRO's",
        "mics_hierarchical_params_gather": "MiCS (sharding within sub-groups of ranks) is a different design",
        "legacy_stage1": "the legacy stage-1 implementation does not exist here",
        "memory_efficient_linear": "zeroedu does not replace torch.nn.Linear's autograd function",
        "zero_quantized_nontrainable_weights": "ZeRO++ here quantizes trainable weights only",
        "stage3_module_granularity_threshold": "zeroedu's stage-3 unit is always one module's own parameters",
        "grad_hooks": "zeroedu's gradient hooks are always on (every stage reduces from them)",
    },
    "fp16": {
        "auto_cast": "zeroedu casts the model to fp16 instead of autocasting its inputs",
        "fp16_master_weights_and_grads": "zeroedu keeps fp32 master weights (the K = 12 of the paper)",
    },
    "bf16": {"immediate_grad_update": "zeroedu accumulates gradients in the compute dtype until the step"},
    "zero_optimization.offload_optimizer": {
        "ratio": "partial optimizer offload (ZeRO-Offload++) is not implemented: the whole shard moves",
    },
    "zero_optimization.offload_param": {},
}

# Accepted at DeepSpeed's default value (then it asks for nothing zeroedu does not do); any other value is refused.
DEFAULT_ONLY: dict[str, dict[str, tuple[Any, str]]] = {
    "": {
        "prescale_gradients": (False, "zeroedu averages inside the collective, after summing"),
        "gradient_predivide_factor": (1.0, "zeroedu averages inside the collective, after summing"),
        "communication_data_type": (None, "zeroedu reduces gradients in the compute dtype"),
        "sparse_gradients": (False, "zeroedu reduces dense gradients only"),
        "seq_parallel_communication_data_type": (None, "sequence parallelism is not implemented"),
        # deepspeed/runtime/constants.py, DATALOADER_DROP_LAST_DEFAULT
        "dataloader_drop_last": (False, "the loader initialize(training_data=...) returns keeps a last, shorter "
                                        "batch, as DeepSpeed's does by default"),
    },
    "zero_optimization": {
        "ignore_unused_parameters": (True, "zeroedu always reduces zeros for a parameter without a gradient"),
        "load_from_fp32_weights": (True, "zeroedu's checkpoints always restore the fp32 master weights"),
        "allgather_partitions": (True, "zeroedu always all-gathers the updated parameters"),
        "log_trace_cache_warnings": (False, "zeroedu's stage 3 re-records its trace only on the first step"),
        # deepspeed/runtime/zero/config.py (0.19.8): parameter_alignment pads stage 1-2's flat buffers so that every
        # parameter starts 16-byte aligned; use_all_reduce_for_fetch_params gathers stage 3's parameters with an
        # all-reduce (twice an all-gather's bytes) to save the host's concatenation.
        "parameter_alignment": (False, "zeroedu pads each bucket to a multiple of N, not each parameter to 16 bytes"),
        "stage3_use_all_reduce_for_fetch_params": (False, "zeroedu gathers parameters with all-gather, the ZeRO "
                                                          "paper's collective, at (N-1)/N of the bytes"),
    },
    "zero_optimization.offload_optimizer": {
        "super_offload": (False, "SuperOffload is DeepSpeed's offload for Superchips (Grace Hopper's CPU and GPU "
                                 "sharing one coherent memory); zeroedu's CPU tier is the ordinary one"),
    },
    "bf16": {"check_grad_overflow": (False, "bf16 steps are not checked for overflow here, as by default in "
                                            "DeepSpeed")},
}

REFUSED["bfloat16"] = REFUSED["bf16"]           # DeepSpeed's older name for the section
DEFAULT_ONLY["bfloat16"] = DEFAULT_ONLY["bf16"]

# Accepted with a note: the key changes nothing here; the note says what it does in DeepSpeed and why.
_GPU = "on a GPU machine"
NOTED: dict[str, dict[str, str]] = {
    "": {
        "aio": f"'aio' tunes libaio's NVMe reads and writes (block size, queue depth) {_GPU}; zeroedu's NVMe tier "
               "uses ordinary file reads and writes",
        "zero_allow_untested_optimizer": "zeroedu takes Adam, AdamW and SGD only; any other optimizer is an error",
        "zero_force_ds_cpu_optimizer": "the CPU step is torch's own fused Adam here (DeepSpeed's CPUAdam is a "
                                       "C++ extension)",
    },
    "zero_optimization": {
        "round_robin_gradients": "with CPU offload DeepSpeed reorders a bucket's gradients so that every rank "
                                 "copies an equal share to the host; here every rank's piece of every bucket is "
                                 "already the same size (flat layout), so there is nothing to balance",
        "elastic_checkpoint": "zeroedu's checkpoints load at any world size anyway (zeroedu.checkpoint)",
        "stage3_model_persistence_threshold": "not applied: DeepSpeed caps the total elements kept whole by "
                                              "stage3_param_persistence_threshold (no cap by default); here every "
                                              "unit under that threshold stays whole, however many there are: "
                                              "lower the threshold to keep fewer",
        "cpu_offload_use_pin_memory": "DeepSpeed's deprecated 'cpu_offload_use_pin_memory' sets nothing in DeepSpeed "
                                      "0.19.8 either; write 'pin_memory' inside offload_optimizer or offload_param "
                                      f"(it matters {_GPU} only)",
    },
    "zero_optimization.offload_optimizer": {
        "fast_init": f"'fast_init' speeds up creating the optimizer state on NVMe {_GPU}; the result is the same",
        "pipeline_read": f"'pipeline_read' overlaps NVMe reads with the step {_GPU}; here reads are already "
                         "overlapped with the previous sub-group's step",
        "pipeline_write": f"'pipeline_write' overlaps NVMe writes with the step {_GPU}",
        "pipeline": f"'pipeline' overlaps NVMe reads and writes with the step {_GPU}",
        "cpuadam_cores_perc": ("'cpuadam_cores_perc' is the share of CPU cores DeepSpeed's CPUAdam uses with "
                               "super_offload; the CPU step here is torch's fused Adam on torch's own threads"),
    },
    "zero_optimization.offload_param": {
        "buffer_size": f"'buffer_size' sizes the pinned staging buffers for NVMe parameter reads {_GPU}",
        "max_in_cpu": f"'max_in_cpu' keeps up to this many parameters in host memory before NVMe {_GPU}",
    },
}
PIN_NOTE = ("'{where}.pin_memory' page-locks the host buffers so copies to and from the GPU run at full PCIe "
             "speed and overlap compute " + _GPU + "; on CPU ranks there is nothing to pin")

# What the Hugging Face Trainer writes in place of "auto" (HF docs, "DeepSpeed" integration page).
AUTO_FILLS = {
    "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x world size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "gradient_clipping": "--max_grad_norm (1.0 by default)",
    "optimizer.params.lr": "--learning_rate", "optimizer.params.betas": "[--adam_beta1, --adam_beta2]",
    "optimizer.params.eps": "--adam_epsilon", "optimizer.params.weight_decay": "--weight_decay",
    "scheduler.params.warmup_min_lr": "0", "scheduler.params.warmup_max_lr": "--learning_rate",
    "scheduler.params.warmup_num_steps": "--warmup_steps",
    "scheduler.params.total_num_steps": "the number of optimizer steps the Trainer will take",
    "fp16.enabled": "--fp16", "bf16.enabled": "--bf16",
    "zero_optimization.reduce_bucket_size": "hidden_size x hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 x hidden_size x hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "10 x hidden_size",
}


def auto_problem(where: str, fill: str | None = None) -> str:
    if fill is None and where.startswith("activation_checkpointing."):
        fill = ("nothing: it fills no activation_checkpointing key, so write true or false (a count for "
                "number_checkpoints)")
    fill = fill or AUTO_FILLS.get(where, "the value you mean")
    return (f"'{where}' is \"auto\": a placeholder that the Hugging Face Trainer replaces before DeepSpeed reads "
            f"the config. Outside the Trainer, write the value yourself (the Trainer would write {fill}).")


def classify(section: str, key: str, value: Any, where: str) -> tuple[str, str] | None:
    """What zeroedu says about `key` (of `section`, `where` its full name) when the section does not implement
    it: ("error", the problem and its fix), ("note", why it changes nothing here), ("accepted", "") at DeepSpeed's
    default or as a refused feature switched off; None: not a DeepSpeed key that zeroedu knows (a typo)."""
    if isinstance(value, str) and value == "auto" and key in DEFAULT_ONLY.get(section, {}):
        default = json.dumps(DEFAULT_ONLY[section][key][0])
        return "error", auto_problem(where, f"{default}, DeepSpeed's default, the one value zeroedu takes here")
    if key in NOTED.get(section, {}):
        return "note", NOTED[section][key]
    if key in DEFAULT_ONLY.get(section, {}):
        default, reason = DEFAULT_ONLY[section][key]
        if value == default:
            return "accepted", ""
        return "error", (f"'{where}' is a real DeepSpeed setting that zeroedu does not implement other than at its "
                         f"default {json.dumps(default)}: {reason}. Remove it or set it to {json.dumps(default)}.")
    if key in REFUSED.get(section, {}):
        if value is None or isinstance(value, dict) and value.get("enabled") is False:
            return "accepted", ""  # a feature switched off (or null, DeepSpeed's "not set") asks for nothing
        return "error", (f"'{where}' is a real DeepSpeed setting that zeroedu does not implement: "
                         f"{REFUSED[section][key]}. Remove it to run here.")
    return None


# DeepSpeed's own optimizers (optimizer.type) that zeroedu refuses: it implements torch's Adam, AdamW and SGD.
DEEPSPEED_OPTIMIZERS = {"OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Lion", "MuAdam", "MuAdamW", "MuSGD",
                        "Muon", "Adagrad", "CPUAdam", "FusedAdam"}

# DeepSpeed 0.19.8 still maps these deprecated keys (deepspeed/runtime/zero/config.py: cpu_offload ->
# offload_optimizer, cpu_offload_param -> offload_param, each {"device": "cpu"} when true); so does zeroedu, with a
# note.
DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
