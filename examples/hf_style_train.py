"""A training script written for DeepSpeed, in the style of the Hugging Face Trainer and DeepSpeed-Chat: parameter
groups with and without weight decay, a config-built AdamW and schedule, gradient accumulation, engine.zero_grad()
after each step, and engine.module.state_dict() saved at the end.

It runs under zeroedu by changing one line, the import (tests/test_hf_style_example.py runs it under both and
compares): `import deepspeed` -> `import zeroedu as deepspeed`.

    torchrun --nproc_per_node 2 examples/hf_style_train.py --out /tmp/hf_style   # needs deepspeed installed
"""

from __future__ import annotations

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, STEPS, MICRO, ACCUM = 64, 32, 4, 2, 2

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 1.0,
    # torch_adam: torch's AdamW (DeepSpeed's default FusedAdam is a C++ extension built on first use)
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS, "warmup_num_steps": 1}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
    "steps_per_print": 1000,
}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.mlp(self.norm(h)))


def grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """The Trainer's rule: no weight decay on biases and LayerNorm weights."""
    no_decay = ("bias", "norm.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0}]


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch of next-token pairs (the same global batch whatever the world size)."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, VOCAB, (MICRO * world, 9), generator=gen)
    mine = ids[rank * MICRO: (rank + 1) * MICRO]
    return mine[:, :-1], mine[:, 1:]


def main(out_dir: str, stage: int = 2, offload: bool = False) -> dict:
    config = json.loads(json.dumps(DS_CONFIG))
    config["zero_optimization"]["stage"] = stage
    if offload:   # ZeRO-Offload: the optimizer step on the CPU (with torch_adam, torch's AdamW there too)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = TinyLM()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=grouped_parameters(model, config["optimizer"]["params"]["weight_decay"]),
        config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine.train()
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUM):
            x, y = batch(step, micro, rank, world)
            loss = F.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        engine.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / (world * ACCUM))
    state = engine.module.state_dict()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
    return {"losses": losses, "global_steps": engine.global_steps, "stage": engine.zero_optimization_stage(),
            "lr": scheduler.get_last_lr()[0] if hasattr(scheduler, "get_last_lr") else engine.get_lr()[0]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="hf_style_out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU")
    parser.add_argument("--local_rank", type=int, default=-1)   # the deepspeed launcher passes it
    args = parser.parse_args()
    print(main(args.out, args.stage, args.offload))
