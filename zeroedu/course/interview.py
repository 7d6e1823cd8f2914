"""Notebooks 13 and 15 (the capstone, course part C): verdicts on the interview article's claims, the
cheat sheet, and the live evidence the capstone checks them against."""


from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeroedu import theory
from zeroedu.course.basics import GB, markdown_table, min_time

# ---- notebooks 13_choosing and 15_interview (the capstone): course part C
# =============================================================================================================
GRADES = ("right", "partly right", "wrong")


@dataclass
class Verdict:
    section: str
    where: str
    claim: str
    grade: str
    evidence: str


@dataclass
class Verdicts:
    """The interview notebook's scoreboard: each checked claim with its grade and the evidence behind it."""

    items: list[Verdict] = field(default_factory=list)

    def add(self, section: str, where: str, claim: str, grade: str, evidence: str) -> None:
        if grade not in GRADES:
            raise ValueError(f"grade must be one of {GRADES}, got {grade!r}")
        self.items.append(Verdict(section, where, claim, grade, evidence))

    def table(self, section: str | None = None) -> str:
        rows = [[len(self.items[:i]) + 1, v.where, v.claim, f"**{v.grade}**", v.evidence]
                for i, v in enumerate(self.items) if section is None or v.section == section]
        return markdown_table(rows, ["#", "where in the article", "claim", "verdict", "evidence"])

    def summary(self) -> str:
        rows = [[i + 1, v.section, v.where, v.claim, v.grade] for i, v in enumerate(self.items)]
        return markdown_table(rows, ["#", "appendix", "where in the article", "claim", "verdict"])

    def counts(self) -> dict[str, int]:
        return {g: sum(v.grade == g for v in self.items) for g in GRADES}


def paper_example(psi: float = 7.5e9, world_size: int = 64) -> dict[int, float]:
    """The ZeRO paper's Figure 1 example: model-state GB per GPU at stages 0-3 (7.5B parameters, 64 GPUs)."""
    return {s: theory.model_state_bytes_paper(psi, world_size, s) / GB for s in theory.STAGES}


SHARDED = {0: ("nothing", "不分片"), 1: ("optimizer states (fp32 master + Adam moments)", "优化器状态"),
           2: ("+ gradients", "+ 梯度"), 3: ("+ parameters", "+ 参数")}
BYTES_FORMULA = {0: "(4 + K) Ψ", 1: "4Ψ + KΨ/N", 2: "2Ψ + (2 + K)Ψ/N", 3: "(4 + K)Ψ/N"}


def cheat_sheet_rows(psi: float = 7.5e9, world_size: int = 64, measured: dict | None = None) -> list[list]:
    """One row per stage: what is sharded, bytes per GPU (formula and the paper's example, computed), bytes sent
    per step in the paper's units (computed), and, if `measured` maps stage -> (sent, sent at stage 0) from a
    live ledger, the measured ratio to DDP."""
    example = paper_example(psi, world_size)
    rows = []
    for s in theory.STAGES:
        en, zh = SHARDED[s]
        k = theory.optimizer_K("bf16")
        per_param = theory.model_state_bytes_paper(1, world_size, s, K=k)
        row = [f"ZeRO-{s}", f"{en} / {zh}", f"{BYTES_FORMULA[s]} = {per_param:.3g} B/param",
               f"{example[s]:.1f} GB", f"{theory.comm_volume_paper(s)}Ψ"]
        if measured is not None:
            sent, ddp = measured[s]
            row.append(f"{sent / ddp:.2f}x")
        rows.append(row)
    return rows


# -- the interview notebook's live evidence -------------------------------------------------------------------
def interview_config(stage: int, world_size: int, accum: int = 1, offload: bool = False,
                     offload_param: bool = False, global_batch: int = 16) -> dict:
    """bf16 + Adam at `stage`, a global batch of `global_batch` split over ranks and micro-steps."""
    zero: dict = {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": global_batch // (world_size * accum),
            "gradient_accumulation_steps": accum, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True}, "zero_optimization": zero}


def interview_train(engine, rank: int, world_size: int, steps: int, first: int = 0,
                    global_batch: int = 16) -> list[float]:
    """Train `steps` optimizer steps on TinyGPT's synthetic batches; the mean loss of each step over all ranks."""
    from zeroedu.models import gpt_batch, gpt_loss, shard_batch
    accum, losses = engine.accum, []
    for step in range(first, first + steps):
        x, y = gpt_batch(step, global_batch)
        total = torch.zeros(())
        for micro in range(accum):
            xs, ys = shard_batch(x, y, rank, world_size, micro, accum)
            loss = gpt_loss(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (world_size * accum))
    return losses


def interview_measure(engine) -> dict:
    """What the interview notebook reads from an engine: memory by category and tier, bytes per step."""
    mem = engine.memory()
    return {"resident": mem["resident"], "tiers": mem["tiers"], "per_step": engine.ledger.per_step(1),
            "offload": engine.ledger.per_step(1, kinds=("offload",)),
            "layout": [b.numel for b in engine.layout.buckets], "psi": engine.layout.numel,
            "bucket_bytes_high": getattr(engine, "bucket_bytes_high", 0)}   # stages 2-3: most bucket bytes alive


def _run(stage: int, rank: int, world_size: int, steps: int = 3, buckets: dict | None = None, **kw) -> tuple:
    """`buckets`: zero_optimization keys that replace the notebook's tuned bucket size (None: leave it out)."""
    import zeroedu
    from zeroedu.models import TinyGPT
    config = interview_config(stage, world_size, **kw)
    if buckets is not None:
        zero = {k: v for k, v in config["zero_optimization"].items() if k != "reduce_bucket_size"}
        config["zero_optimization"] = {**zero, **{k: v for k, v in buckets.items() if v is not None}}
    engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=config)
    return engine, interview_train(engine, rank, world_size, steps)


# Stage 1 and 2 with the bucket size left out (zeroedu's default), and stage 2 at DeepSpeed's 5e8; overlap_comm
# off, DeepSpeed's stage-2 default, so that one bucket buffer is alive at a time.
DEFAULT_BUCKET_RUNS = {"stage 1, no size": (1, None), "stage 2, no size": (2, None),
                       "stage 2, 5e8 (DeepSpeed's default)": (2, 500_000_000)}


def interview_four_ranks(rank: int, world_size: int, ckpt: str) -> dict:
    """Stages 0-3, stage 2 + optimizer offload, stage 3 + optimizer and parameter offload, stage 2 with
    accumulation 4, then a stage-2 checkpoint saved (and what an uninterrupted run does next)."""
    out: dict = {s: interview_measure(_run(s, rank, world_size)[0]) for s in theory.STAGES}
    out["offload"] = interview_measure(_run(2, rank, world_size, offload=True)[0])
    out["offload3"] = interview_measure(_run(3, rank, world_size, offload=True, offload_param=True)[0])
    out["accum4"] = interview_measure(_run(2, rank, world_size, accum=4)[0])
    out["default_buckets"] = {name: interview_measure(_run(stage, rank, world_size, buckets={
        "reduce_bucket_size": size, "overlap_comm": False})[0]) for name, (stage, size) in DEFAULT_BUCKET_RUNS.items()}
    engine, out["ckpt_losses"] = _run(2, rank, world_size)
    engine.save_checkpoint(ckpt)
    out["ckpt_weights"] = engine.master_state_dict()
    out["ckpt_next"] = interview_train(engine, rank, world_size, 2, first=3)
    return out


def interview_two_ranks(rank: int, world_size: int, ckpt: str) -> dict:
    """Stages 0-3 on 2 ranks, then the 4-rank stage-2 checkpoint loaded into a stage-3 engine, trained on."""
    import zeroedu
    from zeroedu.models import TinyGPT
    out: dict = {s: interview_measure(_run(s, rank, world_size)[0]) for s in theory.STAGES}
    engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=interview_config(3, world_size))
    engine.load_checkpoint(ckpt)
    out["loaded_weights"] = engine.master_state_dict()
    out["loaded_step"] = engine.global_step
    out["resumed"] = interview_train(engine, rank, world_size, 2, first=3)
    return out


def interview_evidence(ckpt_dir: str | None = None) -> dict:
    """Both launches of the interview notebook: {4: rank 0's results on 4 ranks, 2: rank 0's on 2 ranks}."""
    import zeroedu
    ckpt_dir = ckpt_dir or tempfile.mkdtemp(prefix="zeroedu-interview-")
    four = zeroedu.launch(interview_four_ranks, world_size=4, backend="gloo", args=(ckpt_dir,))[0]
    two = zeroedu.launch(interview_two_ranks, world_size=2, backend="gloo", args=(ckpt_dir,))[0]
    return {4: four, 2: two}


def cpu_adam_rate(numel: int = 2_000_000, repeats: int = 3) -> float:
    """Parameters per second that torch's fused Adam steps on this CPU (fp32 master + two fp32 moments), the
    best of `repeats` steps: the rate a host optimizer step of offload runs at here."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    opt = torch.optim.Adam([p], lr=1e-3, fused=True)
    opt.step()                                              # allocate the moments outside the timing
    return numel / min_time(opt.step, repeats, barrier=False)


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Activation bytes per transformer layer (Korthikanti et al. 2022, Sec. 4): sbh(34 + 5as/h) without tensor
    parallelism; with TP of degree t, sbh(10 + 24/t + 5as/(ht)) (layer norms, dropouts and the residual input stay
    whole on every GPU); with TP and sequence parallelism, sbh(34 + 5as/h)/t."""
    base = s * b * h * (34 + 5 * a * s / h)
    if t == 1:
        return base
    if sequence_parallel:
        return base / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


