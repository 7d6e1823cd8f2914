"""The notebooks' harness: run a config on N ranks, bring results back, line measured up with theory.

A notebook cell should show the idea (a config, a formula, a comparison) and not the plumbing around it. The
plumbing lives here, once, and is tested (tests/test_course.py):

    from zeroedu import course
    cfg = course.ds_config(stage=1, precision="bf16")              # a DeepSpeed-style config
    runs = zeroedu.launch(course.train, world_size=4, backend="gloo", args=(cfg,))
    runs[0]["per_step"], runs[0]["memory"], runs[0]["losses"]      # what every rank returned
    ref_losses, ref_state = course.reference(steps=4)               # one process, the global batch
    course.show(f"Stage 1 sends **{ratio:.2f}x** the bytes of stage 0.")   # prose rendered from a value

Every training here is the same as the tests' and the exercises': TinyGPT (or the config given), the
deterministic batches of zeroedu.models, the global batch split over the ranks (and micro-steps), and the
printed loss is the mean over the global batch. The numbers a rank returns are plain Python (picklable).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeroedu import theory
from zeroedu.vocab import MODEL_STATES

GB = theory.GB

__all__ = ["DEEPSPEED_BUCKETS", "GLOBAL_BATCH", "LR", "STEPS", "compare_rows", "ds_config", "engine_summary",
           "local_engine",
           "markdown_table", "max_rel_diff", "min_time", "model_states", "one_step", "per_rank", "reference",
           "rel_weight_diff", "run_many", "show", "train",
           # notebooks 05-10
           "bucket_stats", "cpu_adam_node_seconds", "offload_config", "offload_runs", "paper_table1", "show_source",
           "stage3_units",
           # notebooks 13 and 15
           "Verdict", "Verdicts", "paper_example", "cheat_sheet_rows", "interview_config", "interview_train",
           "interview_measure", "interview_four_ranks", "interview_two_ranks", "interview_evidence", "cpu_adam_rate",
           "korthikanti_activation_bytes", "time_ring_collectives", "calibrate_link", "ledger_of_one_step",
           "clock_and_ledger", "slowest_rank_samples"]

GLOBAL_BATCH, STEPS, LR = 8, 4, 1e-3
# DeepSpeed's default bucket sizes, written out: left out, zeroedu sizes buckets to the model (zeroedu.stages.sizing)
DEEPSPEED_BUCKETS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                     "stage3_max_live_parameters": 1_000_000_000}


# ---- notebooks 00-04 (course part A); general enough for any notebook: reuse before adding -----------------

def ds_config(stage: int = 0, precision: str = "fp32", micro_batch: int | None = None, world_size: int = 4,
              global_batch: int = GLOBAL_BATCH, grad_accum: int = 1, lr: float = LR, clip: float = 0.0,
              bucket: int = 20_000, overlap: bool = True, **zero) -> dict:
    """The DeepSpeed config the notebooks train with. `micro_batch` defaults to global_batch / (N x accum), so
    that every world size sees the same global batch; `zero` adds zero_optimization keys."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if micro_batch is None:
        if global_batch % (world_size * grad_accum):
            raise ValueError(f"a global batch of {global_batch} does not split into {world_size} ranks x "
                             f"{grad_accum} micro-steps; pass micro_batch= or a global_batch that divides")
        micro_batch = global_batch // (world_size * grad_accum)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
              "optimizer": {"type": "Adam", "params": {"lr": lr}},
              "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap, **zero}}
    if clip:
        config["gradient_clipping"] = clip
    return config


def _model(model_cfg=None, seed: int = 0) -> torch.nn.Module:
    from zeroedu.models import TinyGPT

    return TinyGPT(model_cfg, seed=seed)


def local_engine(precision: str = "fp32", micro_batch: int = 8, model_cfg=None, **kw):
    """A stage-0 engine in this one process (a world of one rank): memory anatomy without launching ranks."""
    import zeroedu

    engine, *_ = zeroedu.initialize(model=_model(model_cfg), config=ds_config(
        0, precision, micro_batch=micro_batch, world_size=1, **kw))
    return engine


def one_step(engine, step: int, batch: int, model_cfg=None, rank: int = 0, world_size: int = 1) -> float:
    """One optimizer step of `engine` on global batch number `step` (this rank's share, every micro-step).

    Returns this rank's loss (the mean over its micro-steps); reduce it over ranks yourself if you need the
    global-batch loss (train() does)."""
    from zeroedu.models import gpt_batch, gpt_loss, shard_batch

    x, y = gpt_batch(step, batch, model_cfg)
    total = 0.0
    for micro in range(engine.accum):
        xs, ys = shard_batch(x, y, rank, world_size, micro, engine.accum)
        loss = gpt_loss(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach().float())
    return total / engine.accum


def engine_summary(engine, step: int = 1, since: float | None = None, timeline_step: int | None = None,
                   state: bool = False) -> dict:
    """What a rank sends back about its engine: bytes by category, the ledger of one step, the buckets.

    `since`/`timeline_step`: also the rank's timeline (viz.timeline_data) from that time and step. `state`: the
    full fp32 master weights (every rank takes part in gathering them when the engine is sharded)."""
    from zeroedu import viz

    mem = engine.memory()
    out = {
        "rank": engine.rank, "stage": engine.stage, "psi": engine.layout.numel,
        "memory": mem["resident"], "model_states": mem["model_states"], "peak": mem["peak"],
        "peak_phase": mem["peak_phase"],
        "per_step": engine.ledger.per_step(step),
        "entries": [(e.op, e.phase, e.kind, e.numel, e.sent_bytes) for e in engine.ledger.select(step=step)],
        "scalar_all_reduces": sum(1 for e in engine.ledger.select(step=step, kind="scalar")
                                  if e.op == "all_reduce"),
        "layout": [b.numel for b in engine.layout.buckets],
        "buckets": [(len(b.params), b.numel, b.padded) for b in engine.layout.buckets],
        # stages 2-3 make bucket buffers during backward only: the most bucket bytes alive at once
        "bucket_bytes_high": getattr(engine, "bucket_bytes_high", None),
    }
    if since is not None:
        out["timeline"] = viz.timeline_data(engine, since=since, step=timeline_step)
        out["phases"] = {p: e - s for p, s, e in engine.timeline if s >= since}
    if state:
        out["state"] = engine.master_state_dict()
    return out


def train(rank: int, world_size: int, config: Mapping, steps: int = STEPS, global_batch: int = GLOBAL_BATCH,
          model_cfg=None, state: bool = False, timeline: bool = False, track_step: int | None = None,
          engine_hook: Callable | None = None) -> dict:
    """Train TinyGPT on this rank with `config` for `steps` steps; return losses and engine_summary(...).

    For zeroedu.launch(course.train, world_size=N, args=(config,)). losses[i] is the global-batch loss of step
    i (reduced over ranks outside the engine, so it is not in the ledger). `timeline`: the last step's
    per-rank timeline; `track_step`: the step whose peak memory is tracked; `engine_hook(engine)`: its
    return value is added as "extra" (anything else a notebook wants to read off the live engine)."""
    import zeroedu

    engine, *_ = zeroedu.initialize(model=_model(model_cfg), config=dict(config))
    losses, since = [], None
    for step in range(steps):
        if timeline and step == steps - 1:
            since = time.time()
        if step == track_step:
            with engine.track_memory():
                loss = one_step(engine, step, global_batch, model_cfg, rank, world_size)
        else:
            loss = one_step(engine, step, global_batch, model_cfg, rank, world_size)
        total = torch.tensor([loss], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world_size)
    out = engine_summary(engine, step=min(1, steps - 1), since=since,
                         timeline_step=steps - 1 if timeline else None, state=state)
    out["losses"] = losses
    if engine_hook is not None:
        out["extra"] = engine_hook(engine)
    return out


def run_many(rank: int, world_size: int, runs: Mapping[str, tuple[Mapping, dict]]) -> dict:
    """Several trainings in one launch (starting ranks is the slow part on a laptop): {name: (config, kwargs)}
    -> {name: train(rank, world_size, config, **kwargs)}."""
    return {name: train(rank, world_size, cfg, **kw) for name, (cfg, kw) in runs.items()}


def per_rank(results: Sequence[Mapping], key: str) -> list:
    """[r[key] for r in results]: one entry per rank."""
    return [r[key] for r in results]


def reference(steps: int = STEPS, global_batch: int = GLOBAL_BATCH, lr: float = LR, model_cfg=None,
              clip: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batch with torch's own Adam: the yardstick every stage must match."""
    from zeroedu.models import gpt_batch, gpt_loss

    model = _model(model_cfg)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = gpt_batch(step, global_batch, model_cfg)
        loss = gpt_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_rel_diff(state: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    """The largest ||state[k] - ref[k]|| / ||ref[k]|| over the floating-point tensors both hold."""
    keys = [k for k in ref if k in state and ref[k].is_floating_point()]
    if not keys:
        raise ValueError("max_rel_diff: the two state dicts share no floating-point tensor")
    return max(((state[k].float() - ref[k].float()).norm() / ref[k].float().norm()).item() for k in keys)


def rel_weight_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all the tensors of b, as one vector."""
    num = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in b)
    den = sum(float(b[k].float().norm() ** 2) for k in b)
    return (num / den) ** 0.5


def compare_rows(label: str, measured: Mapping[str, int], theory: Mapping[str, int],
                 keys: Iterable[str] | None = None, total: str = "total") -> list[list]:
    """Table rows [label, key, measured, theory, equal] for each key, then one for their sum (`total`)."""
    keys = list(keys if keys is not None else [k for k in theory if k != total])
    rows = [[label, k, measured.get(k, 0), theory.get(k, 0), measured.get(k, 0) == theory.get(k, 0)] for k in keys]
    got, want = sum(measured.get(k, 0) for k in keys), sum(theory.get(k, 0) for k in keys)
    return rows + [[label, f"= {total}", got, want, got == want]]


def model_states(memory: Mapping[str, int]) -> dict[str, int]:
    """The four model-state categories of an engine's memory report (0 where absent)."""
    return {c: memory.get(c, 0) for c in MODEL_STATES}


def min_time(fn: Callable[[], object], repeats: int = 3, barrier: bool = True) -> float:
    """The fastest of `repeats` timed calls of fn (the run least disturbed by other processes), in seconds.
    With `barrier`, all ranks start each call together, so a collective's time is not a rank's wait."""
    best = float("inf")
    for _ in range(repeats):
        if barrier and dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def markdown_table(rows: Iterable[Sequence], headers: Sequence[str]) -> str:
    """A GitHub-flavoured Markdown table (for course.show); `|` in a cell is escaped."""
    def cell(v) -> str:
        text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: a row has {len(row)} cells, the headers {len(headers)}: {row!r}")
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


def show(text: str) -> None:
    """Display `text` as Markdown in the notebook (prose rendered from measured values cannot go stale).

    Outside IPython (a script, a test) it prints the text."""
    from IPython import get_ipython
    from IPython.display import Markdown, display

    if get_ipython() is None:
        print(text)
    else:
        display(Markdown(text))


def show_source(*objects) -> str:
    """The source of functions or methods (inspect.getsource), shown as one Python code block in the notebook:
    where a notebook explains a stage, the stage's real code sits next to the paper's equation."""
    import inspect
    import textwrap

    text = "\n".join(textwrap.dedent(inspect.getsource(o)) for o in objects)
    show(f"```python\n{text.rstrip()}\n```")
    return text



def bucket_stats(summary: Mapping) -> dict[str, int]:
    """From engine_summary(...): the number of buckets, the reduce-scatters of the summarised step, and the
    largest bucket's padded size in elements (what stage 2's bucket buffers are sized to)."""
    return {"buckets": len(summary["buckets"]),
            "reduce_scatters": sum(1 for e in summary["entries"] if e[0] == "reduce_scatter"),
            "largest_bucket": max(padded for _, _, padded in summary["buckets"])}


def stage3_units(engine) -> dict | None:
    """engine_hook for train(): a stage-3 engine's units as (module name, its parameter names, elements), and the
    sizes of the persistent ones. None at other stages."""
    if engine.stage != 3:
        return None
    names = {m: n or "(the model itself)" for n, m in engine.module.named_modules()}
    units = []
    for m, b in zip(engine.unit_modules, engine.layout.buckets, strict=True):
        mine = {id(p) for p in b.params}
        units.append((names[m], [n for n, p in m.named_parameters(recurse=False) if id(p) in mine], b.numel))
    return {"units": units, "persistent": [engine.layout.buckets[u].numel for u in sorted(engine.persistent)]}


def paper_table1(psi: float = 7.5e9, worlds: Sequence[int] = (1, 4, 16, 64, 256, 1024), k: int = 12) -> list[list]:
    """Rows [N, stage 0, stage 1, stage 2, stage 3] in GB (1e9 bytes): model states per device for Psi parameters
    in mixed precision, over the data-parallel degree N, as the ZeRO paper's Table 1 sweeps it."""
    from zeroedu import theory

    return [[n, *(theory.model_state_bytes_paper(psi, n, s, k) / 1e9 for s in range(4))] for n in worlds]


def offload_config(stage: int, opt: str = "none", param: str = "none", nvme_path: str | None = None,
                   micro_batch: int = 4, bucket: int = 20_000) -> dict:
    """Notebook 08's config: bf16 + Adam at `stage`, optimizer state and (stage 3) parameters on the tier named
    ("none", "cpu" or "nvme"; NVMe needs nvme_path)."""
    def tier(device: str) -> dict:
        if device != "nvme":
            return {"device": device}
        if not nvme_path:
            raise ValueError("offload_config: the NVMe tier needs nvme_path= (a folder on a local disk)")
        return {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}

    return {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": tier(opt), "offload_param": tier(param)}}


def _swap_files(engine, root: str | None) -> dict[str, int]:
    import os

    out = {}
    for folder in getattr(engine, "swap_folders", []):
        for d, _, files in os.walk(folder):
            for f in files:
                out[os.path.relpath(os.path.join(d, f), root or folder)] = os.path.getsize(os.path.join(d, f))
    return out


def offload_runs(rank: int, world_size: int, configs: Mapping[str, Mapping], steps: int = 6,
                 nvme_path: str | None = None) -> dict:
    """Notebook 08's launch: every config trained side by side, **taking turns step by step** (one step of each
    engine, then the next step of each), so that a machine that gets busier or quieter during the run slows them
    alike; the first step (warm-up: first-touch allocations, Adam creating its state) is left out of the times.

    Per config: the losses, the step times ("seconds": the fastest timed step; "median"), bytes by tier, the
    offload ledger of the last step, the last step's timeline and the NVMe swap files."""
    import statistics

    import zeroedu
    from zeroedu.models import TinyGPT, gpt_batch, gpt_loss, shard_batch

    engines = {name: zeroedu.initialize(model=TinyGPT(seed=0), config=dict(cfg))[0] for name, cfg in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    losses: dict[str, list[float]] = {name: [] for name in configs}
    starts: dict[str, float] = {}
    for s in range(steps):
        xs, ys = shard_batch(*gpt_batch(s, 4 * world_size), rank, world_size)
        for name, engine in engines.items():
            dist.barrier()
            t0 = time.time()
            losses[name].append(engine.train_batch((xs, ys), gpt_loss))
            times[name].append(time.time() - t0)
            starts[name] = t0
    out = {}
    last = steps - 1
    for name, engine in engines.items():
        t0 = starts[name]
        out[name] = {
            # the fastest step: on a machine shared with other jobs, the one least disturbed by them
            "losses": losses[name], "seconds": min(times[name][1:]), "median": statistics.median(times[name][1:]),
            "times": times[name],
            "tiers": engine.memory()["tiers"], "layout": [b.numel for b in engine.layout.buckets],
            "psi": sum(b.numel for b in engine.layout.buckets),
            "moved": engine.ledger.by("op", kind="offload", step=last),
            "moved_by_phase": engine.ledger.by("phase", "op", kind="offload", step=last),
            "copy_seconds": engine.ledger.by("op", field="seconds", kind="offload", step=last),
            "phases": {p: e - b for p, b, e in engine.timeline if b >= t0},
            "adam_seconds": sum(e - b for _, b, e in getattr(engine, "adam_timeline", []) if b >= t0),
            "timeline": {"t0": t0, "compute": [c for c in engine.timeline if c[1] >= t0],
                         "adam": [a for a in getattr(engine, "adam_timeline", []) if a[1] >= t0],
                         "events": [(e.op, e.kind, e.start, e.seconds) for e in engine.ledger if e.start >= t0]},
            "files": _swap_files(engine, nvme_path),
        }
        if hasattr(engine, "close"):
            engine.close()        # deletes this rank's NVMe swap folder
    return out


def cpu_adam_node_seconds(psi: float, gpus_per_node: int, nodes: int, params_per_s: float) -> dict[str, float]:
    """The host optimizer step of ZeRO-Offload, per step: every rank steps its Psi/N shard on the CPU, and the
    gpus_per_node ranks of a node share that node's CPU, so one node steps Psi/nodes parameters, whatever the
    number of GPUs inside it. `params_per_s`: a whole node's CPU Adam rate."""
    n = gpus_per_node * nodes
    return {"shard_params": psi / n, "node_params": psi / nodes, "node_seconds": psi / nodes / params_per_s}


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
            "layout": [b.numel for b in engine.layout.buckets], "psi": engine.layout.numel}


def _run(stage: int, rank: int, world_size: int, steps: int = 3, **kw) -> tuple:
    import zeroedu
    from zeroedu.models import TinyGPT
    engine, *_ = zeroedu.initialize(model=TinyGPT(seed=0), config=interview_config(stage, world_size, **kw))
    return engine, interview_train(engine, rank, world_size, steps)


def interview_four_ranks(rank: int, world_size: int, ckpt: str) -> dict:
    """Stages 0-3, stage 2 + optimizer offload, stage 3 + optimizer and parameter offload, stage 2 with
    accumulation 4, then a stage-2 checkpoint saved (and what an uninterrupted run does next)."""
    out: dict = {s: interview_measure(_run(s, rank, world_size)[0]) for s in theory.STAGES}
    out["offload"] = interview_measure(_run(2, rank, world_size, offload=True)[0])
    out["offload3"] = interview_measure(_run(3, rank, world_size, offload=True, offload_param=True)[0])
    out["accum4"] = interview_measure(_run(2, rank, world_size, accum=4)[0])
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


# -- the choosing notebook's check of the planner ---------------------------------------------------------------
RING_SWEEP = tuple(16 * 1024 * 4**k for k in range(6))       # 16 KiB ... 16 MiB, as notebook 02 sweeps


def time_ring_collectives(sizes: Sequence[int] = RING_SWEEP, tries: int = 3) -> list[tuple[str, int, int, float]]:
    """On a rank: time zeroedu's ring all-reduce, reduce-scatter and all-gather of each size in bytes (fp32), the
    fastest of `tries` (each after a barrier, min_time). Returns (op, bytes, world size, seconds) samples for
    calibrate_link (or planner.calibrate). The sweep reaches 16 MiB: below about 1 MiB a loaded CPU's times are
    mostly latency and scatter, and only the large sizes show the bandwidth."""
    from zeroedu.comm import Comm
    world_size = dist.get_world_size()
    comm, samples = Comm(implementation="ring"), []
    for nbytes in sizes:
        x, piece = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world_size)
        run = {"all_reduce": lambda x=x: comm.all_reduce(x, average=False),
               "reduce_scatter": lambda x=x, piece=piece: comm.reduce_scatter(piece, x, average=False),
               "all_gather": lambda x=x, piece=piece: comm.all_gather(x, piece)}
        samples += [(op, nbytes, world_size, min_time(fn, tries)) for op, fn in run.items()]
    return samples


def calibrate_link(samples: Iterable[tuple[str, int, int, float]], name: str = "this machine",
                   source: str = "timed ring collectives") -> tuple:
    """planner.calibrate for a notebook: (Link, note), and never an error on flat, noisy timings.

    `samples` are (op, nbytes, world_size, seconds), as time_ring_collectives returns them. When the times grow
    with the bytes, this is planner.calibrate's alpha-beta fit and `note` is "". On a loaded machine they may not:
    every size takes about as long as the scheduler lets it, the best-fitting line slopes down, and
    theory.fit_alpha_beta refuses it ("times do not grow with bytes"). Then alpha is set to 0 and beta is the
    least-squares bandwidth on the relative error (theory.fit_alpha_beta's own fallback when alpha comes out
    negative), and `note` says so in a sentence a notebook can show next to the numbers."""
    from zeroedu import planner

    samples = list(samples)
    try:
        return planner.calibrate(samples, name=name, source=source), ""
    except ValueError as err:
        if "do not grow with bytes" not in str(err):
            raise
    rows = [(theory.ring_sent_bytes(op, nbytes, n), seconds) for op, nbytes, n, seconds in samples
            if op in theory.RING_OPS and n > 1]
    per_s = [sent / seconds for sent, seconds in rows]             # each sample's own bandwidth, bytes/s
    beta = sum(b * b for b in per_s) / sum(per_s)                  # argmin of sum (sent / (beta t) - 1)^2
    link = planner.Link(name, 0.0, beta, f"alpha set to 0, beta fitted alone, to {len(rows)} collectives from "
                                         f"{source}")
    note = (f"These timings do not grow with the message size (the machine was busy: each collective took about "
            f"as long as the scheduler let it), so no line with a positive latency and bandwidth fits them. "
            f"The fit falls back to **alpha = 0** and the least-squares bandwidth, **beta = "
            f"{beta / 1e9:.2f} GB/s**: read this fit as this run's noise, not as this machine's network.")
    return link, note


def ledger_of_one_step(rank: int, world_size: int, d_model: int = 128, n_layer: int = 4) -> tuple[dict, int]:
    """Train a TinyGPT two steps at every stage, with ring collectives, no overlap and no stage-3 prefetch, so
    that each collective's time in the ledger is its own. Returns ({stage: the ledger rows of step 1}, psi)."""
    import zeroedu
    from zeroedu.models import TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss, shard_batch
    cfg, steps = TinyGPTConfig(d_model=d_model, n_layer=n_layer), {}
    for stage in theory.STAGES:
        engine, *_ = zeroedu.initialize(model=TinyGPT(cfg, seed=0), config={
            "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True}, "comm_implementation": "ring",
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000, "overlap_comm": False,
                                  "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}})
        for step in range(2):
            x, y = shard_batch(*gpt_batch(step, 2 * world_size, cfg), rank, world_size)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
        steps[stage] = [r for r in engine.ledger.rows() if r["step"] == 1 and r["kind"] in ("params", "grads")]
    return steps, engine.layout.numel


def clock_and_ledger(rank: int, world_size: int) -> dict:
    """One launch of notebook 13: the timed collectives (the clock) and one step's ledger at every stage."""
    samples = time_ring_collectives()
    steps, psi = ledger_of_one_step(rank, world_size)
    return {"samples": samples, "steps": steps, "psi": psi}


def slowest_rank_samples(results: Sequence[dict]) -> list[tuple[str, int, int, float]]:
    """Each timed collective at the time of its slowest rank: a collective ends when its last rank is done."""
    return [(op, nbytes, n, max(r["samples"][i][3] for r in results))
            for i, (op, nbytes, n, _) in enumerate(results[0]["samples"])]
