"""Checkpoints: every rank saves its shard, any stage on any number of ranks loads it, one command merges it.

What a checkpoint holds. The fp32 master weights and the optimizer state are the whole training state: the
compute parameters are a cast of the master weights (or, in fp32, the same tensors) and the gradients are
zero at an optimizer-step boundary, which is the only place a checkpoint is taken. So each rank writes its
1/N shard of the master weights and of every optimizer tensor (Adam's exp_avg and exp_avg_sq), cut exactly
as stage 1 cuts them: this rank's piece of every padded bucket, back to back. Stage 0 holds everything on
every rank, and still writes only its 1/N: the write is parallel at every stage and the files have one
format. Next to the shard go the small things: RNG states (Python, NumPy, torch, CUDA), the client's own state,
the optimizer's hyperparameters and step count, and (rank 0) the module's buffers. The loss scaler and the step
counters are the same on every rank and go in the metadata.

The data position is two things. The step counters (global_step, micro_step) say how many batches the run has
consumed; zeroedu's course data is a function of the step, so they are enough there. A data loader with a
position of its own (a sampler's index, an epoch) goes in `client_state`, which each rank saves in its own file
and gets back from `load_checkpoint`, as in DeepSpeed.

    DIR/TAG/metadata.json   stage, world size, dtypes, every parameter's name, shape, bucket and offset,
                            every bucket's padding, the sha256 of every file, counters, loss scaler
    DIR/TAG/rank{r}.pt      rank r's shard (torch.save; loaded with torch.load(weights_only=True))
    DIR/latest              the tag of the newest checkpoint, as DeepSpeed writes it

Changing stage or world size is one call, `engine.load_checkpoint(DIR)` on the new engine: the metadata
says where every element of every parameter lives in the old shards, and each rank copies out the elements
its own shard needs under its own layout (`Layout.runs`). Nothing is converted in between.

Atomic saves: the ranks write into DIR/.TAG.partial; once every rank's file is complete, rank 0 writes the
metadata and renames the directory to DIR/TAG (a rename is atomic). A crash before that leaves DIR/TAG
untouched (or absent); a crash while an existing DIR/TAG is being replaced leaves the old one complete in
DIR/.TAG.previous, where loading finds it.

Safe, all-or-nothing loads: every file is checked (present, size, sha256, contents against the metadata)
and every rank reports what it found before any rank changes its engine, so a bad checkpoint raises the
same error on every rank and leaves every engine as it was.

It reads and writes an engine through three hooks of the engine protocol (zeroedu.engine.Engine; Engine's
defaults read `engine.master_pieces` and `engine.optimizer.state`, offload overrides them):
- `checkpoint_master() -> list[Tensor]`: the fp32 master piece of each bucket (this rank's piece, or the
  whole bucket at stage 0), wherever it lives;
- `checkpoint_optimizer_state() -> list[dict]`: the optimizer state of each piece ({name: tensor or value});
- `restore_checkpoint(master: list[Tensor], state: list[dict] | None)`: put both back (state None: keep
  the optimizer state as it is); the caller then runs `engine.publish()`.

The parts: the format and its checks in zeroedu.checkpoint_format, durable writes and the commit in
zeroedu.checkpoint_files, what is taken from and put back into an engine in zeroedu.checkpoint_state. This module
runs a save and a load on every rank, and consolidates.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zeroedu.checkpoint.fileformat import (
    FORMAT,
    LATEST,
    METADATA,
    CheckpointError,
    Layout,
    check_file,
    check_size,
    check_tag,
    file_sha256,
    open_shard,
    read_metadata,
    resolve,
)
from zeroedu.checkpoint.fileformat import (
    FORMAT_VERSION as FORMAT_VERSION,  # zeroedu.checkpoint.FORMAT_VERSION, as before
)
from zeroedu.checkpoint.files import commit_folder, fsync_dir, write_atomic, write_checked
from zeroedu.checkpoint.state import (
    build_metadata,
    check_model,
    extra_state,
    master_weights,
    my_shard,
    optimizer_state,
    restore,
    rng_state,
    set_rng_state,
    split_state,
    window,
)

__all__ = ["CheckpointError", "consolidate", "load", "main", "read_metadata", "save"]


# -- collective bookkeeping (outside the engine's ledger: not training traffic) -----------------------------

def _gather(engine, obj: Any) -> list:
    out: list = [None] * engine.world_size
    dist.all_gather_object(out, obj, group=engine.comm.group)
    return out


def _raise_first(results: list, what: str, partial: str | None = None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed (results: error text or None). Every rank
    has stopped writing by then, so the one given `partial` (rank 0) removes that unfinished save first."""
    failed = [(r, e) for r, e in enumerate(results) if e]
    if failed:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        r, e = failed[0]
        more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise CheckpointError(f"{what} failed on rank {r}{more}: {e}")


def _error_text(e: Exception) -> str:
    """What a rank tells the others about its failure: a CheckpointError's message, else the exception."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


# -- save -----------------------------------------------------------------------------------------------------

def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True) -> str:
    """Every rank writes its shard of DIR/TAG, rank 0 the metadata; returns DIR/TAG. Call it on every rank.

    `tag` defaults to "global_step{N}" (DeepSpeed's default). `client_state` is any dict torch.load(weights_only=
    True) can read back (numbers, strings, tensors, lists): `load` returns it, e.g. for a data loader's position.
    """
    tag = _save_tag(engine, tag, client_state)
    engine.wait()
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    rank = engine.rank
    error = _make_partial(save_dir, partial) if rank == 0 else None
    _raise_first(_gather(engine, error), "save_checkpoint")
    # No checkpoint of steps whose ranks drifted apart: the last steps' agreement checks are read first. Here, after
    # the gather above, every rank is known to be saving (a rank that is not is named by launch() at that gather).
    if getattr(engine.comm, "agreement", None) is not None:
        try:
            engine.comm.agreement.finish("save_checkpoint()")
        except Exception:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise

    info: dict | None = None
    parts, error = None, None
    try:
        info, parts = _write_shard(engine, partial, client_state)
    except Exception as e:   # every rank learns of it below, instead of waiting forever for this one
        error = _error_text(e)
    results = _gather(engine, (error, info))
    _raise_first([e for e, _ in results], "save_checkpoint", partial if rank == 0 else None)

    error = None
    if rank == 0:
        try:
            _write_metadata(engine, tag, [i for _, i in results], parts, partial)
            commit_folder(partial, final)
            if save_latest:
                write_atomic(os.path.join(save_dir, LATEST), lambda fh: fh.write(tag.encode()))
        except Exception as e:
            error = _error_text(e)
    # nobody returns before the checkpoint exists
    _raise_first(_gather(engine, error), "save_checkpoint", partial if rank == 0 else None)
    return final


def _save_tag(engine, tag: str | None, client_state: dict | None) -> str:
    """The tag to save under, once the engine is at a step boundary and client_state is a dict."""
    if engine.micro_step % engine.accum:
        raise CheckpointError(f"save_checkpoint at micro-step {engine.micro_step} is in the middle of gradient "
                              f"accumulation ({engine.accum} micro-steps per step): the partial gradients would be "
                              "lost. Save right after the engine.step() that completes an optimizer step.")
    if client_state is not None and not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    tag = tag or f"global_step{engine.global_step}"
    check_tag(tag)
    return tag


def _check_client_state(client_state: dict) -> None:
    """Refuse, naming the key, a client_state that load could not read back: load_checkpoint reads every shard
    with torch.load(weights_only=True), which refuses numpy values and arbitrary objects, so saving one would
    make the whole checkpoint unloadable."""
    bad = _unloadable(client_state, "client_state")
    if bad:
        where, value = bad
        raise CheckpointError(
            f"{where} is {type(value).__module__}.{type(value).__qualname__} {value!r:.60}, which "
            "load_checkpoint could not read back (it loads with torch.load(weights_only=True)), so the checkpoint "
            "would not load. Store plain Python values or tensors: int(x) or x.item() for a numpy scalar, "
            "torch.from_numpy(a) or a.tolist() for an array.")


def _unloadable(obj: Any, where: str) -> tuple[str, Any] | None:
    """(path, value) of the first part of obj that torch.load(weights_only=True) refuses, or None."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
        return None
    except Exception:
        pass
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for key, value in items:
        found = _unloadable(value, f"{where}[{key!r}]")
        if found:
            return found
    if isinstance(obj, dict) and any(_unloadable(k, where) for k in obj):
        key = next(k for k in obj if _unloadable(k, where))
        return f"a key of {where}", key
    return where, obj


def _make_partial(save_dir: str, partial: str) -> str | None:
    """Rank 0: an empty DIR/.TAG.partial for the ranks to write into; the error text if it cannot be made."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)   # left by a crashed save
        os.makedirs(partial)
    except OSError as e:
        return f"cannot create {partial}: {e}"
    return None


def _write_shard(engine, partial: str, client_state: dict | None) -> tuple[dict, tuple[list[str], dict, dict]]:
    """Write this rank's rank{r}.pt into `partial`. Returns its entry for the metadata's file list, and what the
    metadata needs besides: the per-element optimizer state keys, the scalar state, the buffers (rank 0)."""
    rank = engine.rank
    if client_state:   # here, so that every rank hears of it (a rank's client_state is its own)
        _check_client_state(client_state)
    master = master_weights(engine)
    states = optimizer_state(engine)
    elem, scalars = split_state(states, master)
    extras = extra_state(engine) if rank == 0 else {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    shard = {
        "format": FORMAT, "rank": rank, "world_size": engine.world_size,
        "master": my_shard(engine, [m.float() for m in master]),
        "optimizer": {k: my_shard(engine, [s[k] for s in states]) for k in elem},
        "optimizer_scalars": scalars, "param_groups": groups,
        "rng": rng_state(), "client_state": dict(client_state or {}),
        "extras": {k: v.clone() for k, v in extras.items()},
    }
    name = f"rank{rank}.pt"
    f = os.path.join(partial, name)
    write_checked(f, lambda fh: torch.save(shard, fh))
    info = {"name": name, "rank": rank, "bytes": os.path.getsize(f), "sha256": file_sha256(f),
            "tensor_bytes": sum(t.numel() * t.element_size() for t in [shard["master"], *shard["optimizer"]
                                                                     .values()])}
    return info, (elem, scalars, extras)


def _write_metadata(engine, tag: str, files: list[dict], parts: tuple[list[str], dict, dict], partial: str) -> None:
    """Rank 0, once every rank's file is complete: DIR/.TAG.partial/metadata.json, flushed with its folder."""
    elem, scalars, extras = parts
    meta = build_metadata(engine, tag, files, elem, scalars, extras)
    write_checked(os.path.join(partial, METADATA), lambda fh: fh.write(json.dumps(meta, indent=1).encode()))
    fsync_dir(partial)


# -- load -----------------------------------------------------------------------------------------------------

def _read_for_rank(engine, path: str, meta: dict, load_optimizer_states: bool) -> dict:
    """Everything this rank needs, read and checked, in new tensors; the engine is not touched."""
    check_model(meta, engine, path)
    elem = meta["optimizer"]["state_keys"] if load_optimizer_states else []
    if load_optimizer_states and meta["optimizer"]["type"] != type(engine.optimizer).__name__:
        raise CheckpointError(f"{os.path.join(path, METADATA)}: the checkpoint holds {meta['optimizer']['type']} "
                              f"state, this engine uses {type(engine.optimizer).__name__}. Configure the same "
                              "optimizer, or pass load_optimizer_states=False to load the weights only.")
    src = Layout.of(meta)
    master = master_weights(engine)
    dst = {k: [torch.zeros(m.numel(), dtype=torch.float32) for m in master] for k in ["master", *elem]}
    plan: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(src.world_size)}
    for i, (b, m) in enumerate(zip(engine.layout.buckets, master, strict=True)):
        lo = window(engine, b, m)
        hi = lo + m.numel()
        for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
            e0, e1 = max(lo, off) - off, min(hi, off + shape.numel()) - off
            for r, s, e, n in (src.runs(engine.names[p], e0, e1) if e0 < e1 else ()):
                plan[r].append((i, off + e - lo, s, n))
    own = engine.rank if engine.rank < src.world_size else 0
    needed = sorted({r for r, runs in plan.items() if runs} | {own, 0})
    # Every file is checked by some rank, even one that no rank needs (a shard of padding only).
    checked = {info["rank"] for info in meta["files"][engine.rank::engine.world_size]}
    for r in sorted(checked):
        check_file(path, meta["files"][r])
    out: dict = {"tensors": dst}
    for r in needed:
        data = open_shard(path, meta["files"][r], meta, checked=r in checked)
        for key, tensors in dst.items():
            srcs = data["master"] if key == "master" else data["optimizer"][key]
            for i, d, s, n in plan[r]:
                tensors[i][d: d + n].copy_(srcs[s: s + n])
        if r == own:
            out.update(rng=data["rng"], client_state=data["client_state"], param_groups=data["param_groups"],
                       scalars=data["optimizer_scalars"])
        if r == 0:
            out["extras"] = {k: v.clone() for k, v in data["extras"].items()}
        del data
    if load_optimizer_states and len(out["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"{path}: the checkpoint has {len(out['param_groups'])} optimizer parameter groups, "
                              f"this engine {len(engine.optimizer.param_groups)}")
    return out


def load(engine, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
         load_module_only: bool = False) -> tuple[str, dict]:
    """Load a checkpoint saved at any stage on any number of ranks into `engine`; call it on every rank.

    Returns `(path, client_state)` like DeepSpeed (client_state: this rank's, or rank 0's if the checkpoint
    had fewer ranks). Restores master weights, optimizer state and hyperparameters (unless
    load_optimizer_states=False), the loss scaler (fp16 to fp16), step counters, the module's buffers, and
    each rank's RNG states when the world size is the one it was saved with.

    DeepSpeed's other switches: `load_module_only=True` loads the weights and buffers only (optimizer state,
    counters, loss scaler and RNG stay as they are: fine-tuning from a checkpoint); `load_lr_scheduler_states`
    restores the learning-rate schedule's position where the checkpoint and the engine both have one;
    `load_module_strict` must stay True (zeroedu loads a checkpoint only into the model it was saved from).
    """
    if not load_module_strict:
        raise CheckpointError("load_module_strict=False is not implemented in zeroedu: a checkpoint loads only into "
                              "the model it was saved from (same parameter names and shapes). Load it into that "
                              "model, or consolidate it (zeroedu consolidate) and load the state_dict with "
                              "model.load_state_dict(sd, strict=False).")
    load_optimizer_states = load_optimizer_states and not load_module_only
    error, new, path, meta = None, None, "", {}
    try:
        path = resolve(load_dir, tag)
        meta = read_metadata(path)
        new = _read_for_rank(engine, path, meta, load_optimizer_states)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    _raise_first(_gather(engine, error), "load_checkpoint")   # all ranks load, or none changes anything

    with torch.no_grad():     # copies into parameters: not something autograd should record
        _apply(engine, new, meta, load_optimizer_states, load_module_only)
    sched = getattr(engine, "lr_scheduler", None)
    if load_lr_scheduler_states and not load_module_only and sched is not None and meta.get("lr_scheduler"):
        sched.load_state_dict(meta["lr_scheduler"])
    return path, new["client_state"]


def _apply(engine, new: dict, meta: dict, load_optimizer_states: bool, module_only: bool) -> None:
    tensors = new["tensors"]
    state = None
    if load_optimizer_states:
        elem = meta["optimizer"]["state_keys"]
        state = [{**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in new["scalars"].items()},
                  **{k: tensors[k][i] for k in elem}} for i in range(len(tensors["master"]))]
        for group, saved in zip(engine.optimizer.param_groups, new["param_groups"], strict=True):
            group.update(saved)
    restore(engine, tensors["master"], state)
    with engine.comm.in_phase("init"):
        engine.publish()                                # compute parameters from the master weights
        engine.wait()
    current = extra_state(engine)
    for k, v in new["extras"].items():
        current[k].copy_(v)
    if module_only:
        return
    engine.global_step = meta["global_step"]
    engine.micro_step = meta["global_step"] * engine.accum
    engine.skipped_steps = meta["skipped_steps"]
    engine.comm.step = engine.global_step
    if meta["precision"] == "fp16" and engine.precision == "fp16":
        engine.scaler.load_state_dict(meta["loss_scaler"])
    if meta["world_size"] == engine.world_size:
        set_rng_state(new["rng"])


# -- consolidation ---------------------------------------------------------------------------------------------

def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """One fp32 state_dict of the whole model from a sharded checkpoint (DeepSpeed's zero_to_fp32.py).

    The result loads into the unwrapped model with `model.load_state_dict(sd)`: every name of a tied weight,
    and the buffers. Shards are read one at a time (memory-mapped), so the host needs the consolidated model
    plus at most one shard.
    """
    path = resolve(checkpoint_dir, tag)
    meta = read_metadata(path)
    src = Layout.of(meta)
    for info in meta["files"]:   # the files hold what the metadata says, before anything that size is allocated
        if os.path.exists(f := os.path.join(path, info["name"])):
            check_size(f, info)
    flat = {p["name"]: torch.zeros(int(np.prod(p["shape"], dtype=np.int64)), dtype=torch.float32)
            for p in meta["parameters"]}
    plan: dict[int, list] = {r: [] for r in range(src.world_size)}
    for name, t in flat.items():
        for r, s, e, n in src.runs(name, 0, t.numel()):
            plan[r].append((t, e, s, n))
    extras: dict[str, torch.Tensor] = {}
    for r in range(src.world_size):
        data = open_shard(path, meta["files"][r], meta)
        for t, e, s, n in plan[r]:
            t[e: e + n].copy_(data["master"][s: s + n])
        if r == 0:
            extras = {k: (v.float() if v.is_floating_point() else v.clone()) for k, v in data["extras"].items()}
        del data
    by_name = {}
    for p in meta["parameters"]:
        t = flat[p["name"]].view(p["shape"])
        for n in [p["name"], *p["aliases"]]:
            by_name[n] = t                               # tied names share one tensor, as in the model
    by_name.update(extras)
    return {k: by_name[k] for k in meta["state_dict_keys"] if k in by_name}


def main(argv: list[str] | None = None) -> int:
    """`zeroedu consolidate DIR OUT [--tag TAG]`: write the fp32 state_dict of a sharded checkpoint to OUT."""
    parser = argparse.ArgumentParser(prog="zeroedu consolidate", description=consolidate.__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the directory given to save_checkpoint")
    parser.add_argument("output", help="file to write (torch.save; load with torch.load(weights_only=True))")
    parser.add_argument("--tag", default=None, help="which checkpoint (default: the one named in DIR/latest)")
    args = parser.parse_args(argv)
    try:
        sd = consolidate(args.checkpoint_dir, args.tag)
        meta = read_metadata(resolve(args.checkpoint_dir, args.tag))
    except CheckpointError as e:
        print(f"zeroedu consolidate: error: {e}", file=sys.stderr)
        return 1
    try:
        write_atomic(args.output, lambda fh: torch.save(sd, fh))
    except (OSError, CheckpointError) as e:   # a read-only folder, a missing parent folder, a full disk
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"zeroedu consolidate: error: cannot write {args.output}: {why}. Nothing was written; give a path "
              "in a folder you can write to.", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {len(sd)} tensors, {meta['numel']:,} parameters in fp32 "
          f"({os.path.getsize(args.output):,} bytes), from stage {meta['stage']} on {meta['world_size']} rank(s) "
          f"at global step {meta['global_step']}")
    return 0
