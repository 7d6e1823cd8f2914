"""The course's shared words, defined once: model-state categories, precisions, ledger kinds, ZeRO++'s defaults.

No torch here, so the closed forms (theory, planner) and `zeroedu doctor` import it without torch.
"""

from __future__ import annotations

MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_state")
"""The ZeRO paper's model states: what stages 1-3 partition (activations and buffers are not among them)."""

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one parameter (and of its gradient) in each precision the config's fp16/bf16 sections select."""

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Precision -> the name of its torch dtype (zeroedu.precision.DTYPES holds the dtypes themselves)."""

LEDGER_KINDS = {
    "params": "parameters gathered or broadcast (all-gather, broadcast)",
    "grads": "gradients reduced (all-reduce, reduce-scatter, qgZ's all-to-all)",
    "scalar": "a few bytes: the gradient norm, an overflow flag, a skipped step",
    "other": "anything else: non-float buffers broadcast at start, the fp32 master gathered for a state dict",
    "offload": "copies between device, host and NVMe (d2h, h2d, file reads and writes)",
    "activations": "activation checkpointing's partitions and host copies",
    "tp": "tensor parallelism's all-reduces (the course's tensor-parallel MLP)",
}
"""The `kind` of a ledger entry -> what it counts. theory's comm formulas cover "params" and "grads"."""

# ZeRO++ (Wang et al. 2023): the quantizer's defaults, here once, so the engine (zeroedu.zeropp) and the closed
# form (zeroedu.theory.zeropp_comm_bytes) agree unless a caller changes one of them.
ZEROPP_WEIGHT_BITS = 8
"""qwZ: int8 weights, as in the paper and DeepSpeed."""
ZEROPP_GRAD_BITS = 4
"""qgZ: int4 gradients, as in the paper and DeepSpeed (8 is the other choice zeroedu offers)."""
ZEROPP_BLOCK_SIZE = 2048
"""Elements that share one scale, for weights and gradients. DeepSpeed's qwZ kernel picks a group size of up
to 8000 elements per tensor; 2048 keeps zeroedu's small models at several blocks per unit."""
ZEROPP_SCALE_BYTES = 4
"""One fp32 scale per block (symmetric quantization: no zero point)."""
