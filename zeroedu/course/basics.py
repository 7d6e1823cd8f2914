"""Part A of the course harness (notebooks 00-07, and any notebook): configs, training on N ranks, the
single-process reference, comparisons with theory, and rendering prose from values."""


from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from zeroedu import theory
from zeroedu.theory.vocab import MODEL_STATES

GB = theory.GB

GLOBAL_BATCH, STEPS, LR = 8, 4, 1e-3
# DeepSpeed's default bucket sizes, written out: left out, zeroedu sizes buckets to the model (zeroedu.stages.sizing)
DEEPSPEED_BUCKETS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                     "stage3_max_live_parameters": 1_000_000_000}


# ---- notebooks 00-04 (course part A); general enough for any notebook: reuse before adding -----------------

def ds_config(stage: int = 0, precision: str = "fp32", micro_batch: int | None = None, world_size: int = 4,
              global_batch: int = GLOBAL_BATCH, grad_accum: int = 1, lr: float = LR, clip: float = 0.0,
              bucket: int = 20_000, overlap: bool = True, **zero) -> dict:
    """The DeepSpeed config the notebooks train with. `micro_batch` defaults to global_batch / (N x accum), so
    that every world size sees the same global batch; `zero` adds zero_optimization keys. `gradient_clipping` is
    always written out (0: no clipping), because DeepSpeed 0.19.8 clips at 1.0 when the key is left out: a
    graduate who copies a printed config gets the run the lesson measured."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if micro_batch is None:
        if global_batch % (world_size * grad_accum):
            raise ValueError(f"a global batch of {global_batch} does not split into {world_size} ranks x "
                             f"{grad_accum} micro-steps; pass micro_batch= or a global_batch that divides")
        micro_batch = global_batch // (world_size * grad_accum)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
              "gradient_clipping": clip, "optimizer": {"type": "Adam", "params": {"lr": lr}},
              "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": overlap, **zero}}
    return config


def build_model(model_cfg=None, seed: int = 0) -> torch.nn.Module:
    from zeroedu.models import TinyGPT

    return TinyGPT(model_cfg, seed=seed)


def local_engine(precision: str = "fp32", micro_batch: int = 8, model_cfg=None, **kw):
    """A stage-0 engine in this one process (a world of one rank): memory anatomy without launching ranks."""
    import zeroedu

    config = ds_config(0, precision, micro_batch=micro_batch, world_size=1, **kw)
    engine, *_ = zeroedu.initialize(model=build_model(model_cfg), config=config)
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
    from zeroedu.course import viz

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

    engine, *_ = zeroedu.initialize(model=build_model(model_cfg), config=dict(config))
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

    model = build_model(model_cfg)
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
    sizes of the persistent ones and of those kept from forward to backward (reused). None at other stages."""
    if engine.stage != 3:
        return None
    names = {m: n or "(the model itself)" for n, m in engine.module.named_modules()}
    units = []
    for m, b in zip(engine.unit_modules, engine.layout.buckets, strict=True):
        mine = {id(p) for p in b.params}
        units.append((names[m], [n for n, p in m.named_parameters(recurse=False) if id(p) in mine], b.numel))
    return {"units": units, "persistent": [engine.layout.buckets[u].numel for u in sorted(engine.persistent)],
            "reused": [engine.layout.buckets[u].numel for u in sorted(engine.reused)]}


