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
its own shard needs under its own layout (`_Layout.runs`). Nothing is converted in between.

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
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "zeroedu-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"

__all__ = ["CheckpointError", "consolidate", "load", "main", "read_metadata", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""


# -- the engine side ------------------------------------------------------------------------------------------

def _param_entries(engine) -> list[dict]:
    """Every trained parameter in layout order: name, other names (tied weights), shape, bucket, offset."""
    aliases: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out = []
    for b in engine.layout.buckets:
        for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
            name = engine.names[p]
            out.append({"name": name, "aliases": [n for n in aliases[id(p)] if n != name],
                        "shape": list(shape), "bucket": b.index, "offset": off})
    return out


def _extras(engine) -> dict[str, torch.Tensor]:
    """What the module's state_dict holds besides the trained parameters: buffers, frozen parameters."""
    trained = {n for e in _param_entries(engine) for n in [e["name"], *e["aliases"]]}
    return {k: v.detach() for k, v in engine.module.state_dict().items() if k not in trained}


def _master(engine) -> list[torch.Tensor]:
    return engine.checkpoint_master()


def _optimizer_state(engine) -> list[dict]:
    return engine.checkpoint_optimizer_state()


def _restore(engine, master: list[torch.Tensor], state: list[dict] | None) -> None:
    engine.restore_checkpoint(master, state)


def _window(engine, b, piece: torch.Tensor) -> int:
    """Where a master piece starts inside its bucket: 0 if it is the whole bucket (stage 0), else rank x piece."""
    if piece.numel() == b.padded:
        return 0
    if piece.numel() != b.piece:
        raise CheckpointError(f"bucket {b.index}: master piece has {piece.numel()} elements, expected {b.piece} "
                              f"(this rank's piece) or {b.padded} (the whole bucket)")
    return engine.rank * b.piece


def _my_shard(engine, tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's piece of every bucket, back to back (a new tensor), from per-bucket pieces or whole buckets."""
    parts = []
    for b, t in zip(engine.layout.buckets, tensors, strict=True):
        _window(engine, b, t)   # checks the size
        lo = engine.rank * b.piece if t.numel() == b.padded else 0
        parts.append(t.reshape(-1)[lo: lo + b.piece])
    return torch.cat(parts).to("cpu")


def _split_state(states: list[dict], master: list[torch.Tensor]):
    """Optimizer state as per-element tensors (sharded like the master) and per-piece scalars (equal on all)."""
    keys = sorted(states[0]) if states else []
    if any(sorted(s) != keys for s in states):
        raise CheckpointError("the optimizer state differs between buckets (some were never stepped?); "
                              "save after a complete optimizer step")
    elem, scalars = [], {}
    for k in keys:
        vals = [s[k] for s in states]
        if all(isinstance(v, torch.Tensor) and v.numel() == m.numel() and v.dim() > 0
               for v, m in zip(vals, master, strict=True)):
            elem.append(k)
            continue
        first = vals[0]
        same = all((torch.equal(v, first) if isinstance(v, torch.Tensor) else v == first) for v in vals)
        if not same:
            raise CheckpointError(f"optimizer state '{k}' differs between buckets; zeroedu can only save a "
                                  "per-element tensor or a value shared by all parameters")
        scalars[k] = first.detach().clone() if isinstance(first, torch.Tensor) else first
    return elem, scalars


# -- the metadata side ----------------------------------------------------------------------------------------

@dataclass
class _Layout:
    """Where each parameter element sits in the shards of a saved checkpoint."""

    world_size: int
    buckets: list[dict]
    params: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: dict) -> _Layout:
        return cls(meta["world_size"], meta["buckets"], {p["name"]: p for p in meta["parameters"]})

    def runs(self, name: str, e0: int, e1: int):
        """(rank, offset in that rank's shard, element of the parameter, length) covering elements [e0, e1)."""
        p = self.params[name]
        b = self.buckets[p["bucket"]]
        piece = b["padded"] // self.world_size
        while e0 < e1:
            rank, within = divmod(p["offset"] + e0, piece)
            n = min(e1 - e0, piece - within)
            yield rank, b["shard_start"] + within, e0, n
            e0 += n


def _self_hash(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _scheduler_state(engine) -> dict | None:
    """The learning-rate schedule's position (a plain dict), or None without a scheduler."""
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None or not hasattr(sched, "state_dict"):
        return None
    state = sched.state_dict()
    try:
        json.dumps(state)
    except TypeError:   # a client scheduler holding functions or tensors: not kept (the resumed run restarts it)
        return None
    return state


def _metadata(engine, tag: str, files: list[dict], elem: list[str], scalars: dict, extras: dict) -> dict:
    from zeroedu._version import __version__

    zc = engine.config.zero_optimization
    layout = engine.layout
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "zeroedu_version": __version__,
        "torch_version": torch.__version__, "tag": tag,
        "stage": engine.stage, "world_size": engine.world_size, "precision": engine.precision,
        "compute_dtype": str(engine.dtype).removeprefix("torch."), "master_dtype": "float32",
        "offload_optimizer": zc.offload_optimizer.device, "offload_param": zc.offload_param.device,
        "optimizer": {"type": type(engine.optimizer).__name__, "state_keys": elem,
                      "scalar_keys": sorted(scalars)},
        "global_step": engine.global_step, "micro_step": engine.micro_step,
        "skipped_steps": engine.skipped_steps, "gradient_accumulation_steps": engine.accum,
        "loss_scaler": engine.scaler.state_dict(),
        "lr_scheduler": _scheduler_state(engine),
        "numel": layout.numel, "full_numel": layout.full_numel, "shard_numel": layout.shard_numel,
        "padding": layout.full_numel - layout.numel,
        "buckets": [{"numel": b.numel, "padded": b.padded, "start": b.start, "shard_start": b.shard_start}
                    for b in layout.buckets],
        "parameters": _param_entries(engine),
        "extras": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                   for k, v in extras.items()],
        "state_dict_keys": list(engine.module.state_dict().keys()),
        "files": files,
    }
    meta["metadata_sha256"] = _self_hash(meta)
    return meta


def read_metadata(path: str) -> dict:
    """The metadata of the checkpoint directory `path`, checked: format, version, not edited since saving."""
    f = os.path.join(path, METADATA)
    if not os.path.exists(f):
        raise CheckpointError(f"{f} is missing: {path} is not a complete zeroedu checkpoint (a save that was "
                              "interrupted, or a directory of something else)")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} cannot be read as JSON ({e}): the file is truncated or was edited") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{f} is not zeroedu checkpoint metadata (no \"format\": \"{FORMAT}\")")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f} has format version {meta.get('format_version')}; this zeroedu reads version "
                              f"{FORMAT_VERSION}. Load it with the zeroedu version that wrote it "
                              f"({meta.get('zeroedu_version')}).")
    if meta.get("metadata_sha256") != _self_hash(meta):
        raise CheckpointError(f"{f} was modified after it was saved: its metadata_sha256 does not match its "
                              "content. Restore the original file.")
    files = meta.get("files")
    if not isinstance(files, list) or not all(isinstance(i, dict) for i in files):
        raise CheckpointError(f"{f}: \"files\" is not a list of shard entries: the metadata was crafted or damaged")
    for info in files:
        _shard_path(path, info)   # every path checked before any shard is opened
    return meta


def _check_model(meta: dict, engine, path: str) -> None:
    """The checkpoint must describe this engine's model: the same parameter names and shapes."""
    f = os.path.join(path, METADATA)
    theirs = {p["name"]: p["shape"] for p in meta["parameters"]}
    mine = {e["name"]: e["shape"] for e in _param_entries(engine)}
    if theirs.keys() != mine.keys():
        only_ckpt = sorted(theirs.keys() - mine.keys())
        only_model = sorted(mine.keys() - theirs.keys())
        raise CheckpointError(
            f"{f} describes a different model: parameters only in the checkpoint: {only_ckpt[:5]}"
            f"{' ...' if len(only_ckpt) > 5 else ''}; only in this model: {only_model[:5]}"
            f"{' ...' if len(only_model) > 5 else ''}. Build the model the checkpoint was saved from.")
    for name, shape in theirs.items():
        if shape != mine[name]:
            raise CheckpointError(f"{f}: shape mismatch for parameter '{name}': {shape} in the checkpoint, "
                                  f"{mine[name]} in this model. Build the model with the configuration it was "
                                  "saved with.")
    extras = _extras(engine)
    for e in meta["extras"]:
        if e["name"] not in extras or list(extras[e["name"]].shape) != e["shape"]:
            have = list(extras[e["name"]].shape) if e["name"] in extras else "absent"
            raise CheckpointError(f"{f}: buffer '{e['name']}' is {e['shape']} in the checkpoint, {have} in "
                                  "this model. Build the model the checkpoint was saved from.")


# -- files ----------------------------------------------------------------------------------------------------

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class _Counter:
    """A file-like sink that only counts what is written to it: the size a torch.save would have on disk."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _device(path: str) -> str:
    """The file system that holds `path`: its device (or tmpfs, ...) and mount point, as /proc/self/mounts says."""
    mount = os.path.realpath(path)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        with open("/proc/self/mounts") as f:
            devices = [line.split()[0] for line in f if line.split()[1:2] == [mount]]
    except OSError:
        devices = []
    return f"{devices[-1]} (mounted on {mount})" if devices else mount


def _errno_of(e: BaseException) -> int | None:
    """The errno behind an exception, looking through its causes: torch.save reports a failed write as
    RuntimeError("... unexpected pos ...") with the OSError only in __context__."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def _write_checked(path: str, write) -> None:
    """_write, and when the disk (or the file-size limit) is full: remove the piece written and say how many
    bytes the file needs and how many there are, instead of torch's "unexpected pos"."""
    try:
        _write(path, write)
    except Exception as e:
        code = _errno_of(e)
        if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        try:
            os.remove(path)
        except OSError:
            pass
        need = _Counter()
        write(need)
        folder = os.path.dirname(os.path.abspath(path))
        if code == errno.EFBIG:
            import resource  # POSIX only, as file-size limits are

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            raise CheckpointError(f"file too large: {path} needs {need.bytes:,} bytes, but this process may write "
                                  f"files of at most {limit:,} bytes (RLIMIT_FSIZE, `ulimit -f`). Raise the limit, "
                                  "or shard the state over more ranks.") from e
        free = shutil.disk_usage(folder).free
        quota = " (or the disk quota is used up)" if code == errno.EDQUOT else ""
        raise CheckpointError(f"no space left on {_device(folder)}{quota}: {os.path.basename(path)} needs "
                              f"{need.bytes:,} bytes, {free:,} bytes are free. Free some space or save to "
                              "another folder.") from e


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    _write_checked(tmp, write)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _shard_path(path: str, info: dict) -> str:
    """The file a metadata entry names, refused before anything opens it unless it is a plain file name inside
    the checkpoint folder. The metadata's own hash proves only that it was not edited by accident: anyone can
    write a metadata.json, with a matching hash, that names /etc/passwd or ../../secret."""
    name = info.get("name") if isinstance(info, dict) else None
    f = os.path.join(path, name) if isinstance(name, str) else ""
    inside = bool(name) and os.path.basename(name) == name and name not in (".", "..") and \
        os.path.commonpath([os.path.realpath(path), os.path.realpath(f)]) == os.path.realpath(path) and \
        os.path.realpath(f) != os.path.realpath(path)
    if not inside:
        raise CheckpointError(f"{os.path.join(path, METADATA)} names the shard file {name!r}, which is not a file "
                              f"inside {path} (or a link out of it): refused, nothing was opened. A checkpoint's "
                              "files all live in its own folder; this metadata was crafted or damaged. Use a "
                              "checkpoint saved by zeroedu.")
    return f


def _check_file(path: str, info: dict) -> str:
    """The file exists and has the size and sha256 that the metadata recorded; returns its path."""
    f = _shard_path(path, info)
    if not os.path.exists(f):
        raise CheckpointError(f"{f} is missing: {METADATA} lists it (rank {info['rank']}'s shard), so the "
                              "checkpoint is incomplete. Copy the whole checkpoint directory.")
    size = os.path.getsize(f)
    if size < info["bytes"]:
        raise CheckpointError(f"{f} is truncated: {size} bytes, {METADATA} says {info['bytes']}. The copy or the "
                              "save did not finish.")
    if size > info["bytes"]:
        raise CheckpointError(f"{f} is larger than {METADATA} says ({size} bytes, not {info['bytes']}): it was "
                              f"overwritten, or {METADATA} comes from another checkpoint.")
    digest = _sha256(f)
    if digest != info["sha256"]:
        raise CheckpointError(f"{f} was modified or corrupted after it was saved: its sha256 is {digest[:16]}..., "
                              f"{METADATA} says {info['sha256'][:16]}... (or {METADATA} comes from another "
                              "checkpoint)")
    return f


def _open_shard(path: str, info: dict, meta: dict, checked: bool = False) -> dict:
    """torch.load one rank file after checking it against the metadata; raise CheckpointError naming it."""
    f = _shard_path(path, info) if checked else _check_file(path, info)
    try:
        data = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{f} cannot be loaded with torch.load(weights_only=True): {e}") from e
    problems = []
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("rank") != info["rank"]:
        problems.append(f"it is not rank {info['rank']}'s zeroedu shard")
    else:
        for key in ["master", *meta["optimizer"]["state_keys"]]:
            t = data["master"] if key == "master" else data.get("optimizer", {}).get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (meta["shard_numel"],):
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"'{key}' should be float32 [{meta['shard_numel']}], it is {got}")
    if problems:
        raise CheckpointError(f"{f} does not match {METADATA}: {'; '.join(problems)}")
    return data


def resolve(checkpoint_dir: str, tag: str | None = None) -> str:
    """The directory of checkpoint `tag` in `checkpoint_dir` (the one named in `latest` if tag is None)."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir} does not exist")
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.exists(latest):
            raise CheckpointError(f"{latest} is missing, so there is no newest checkpoint to pick: pass tag= "
                                  f"(tags here: {_tags(checkpoint_dir)})")
        with open(latest) as f:
            tag = f.read().strip()
    _check_tag(tag)
    path = os.path.join(checkpoint_dir, tag)
    if os.path.isdir(path):
        return path
    previous = os.path.join(checkpoint_dir, f".{tag}.previous")
    if os.path.isdir(previous):   # a save replacing this tag was interrupted: the old checkpoint is complete
        return previous
    partial = os.path.join(checkpoint_dir, f".{tag}.partial")
    why = f" (a save of it was interrupted: {partial} is incomplete and ignored)" if os.path.exists(partial) else ""
    raise CheckpointError(f"no checkpoint '{tag}' in {checkpoint_dir}{why}; tags here: {_tags(checkpoint_dir)}")


def _tags(checkpoint_dir: str) -> list[str]:
    """The tags that load: DIR/TAG, and DIR/.TAG.previous where a commit replacing TAG was interrupted (resolve
    finds it there)."""
    tags = set()
    for d in os.listdir(checkpoint_dir):
        if not os.path.exists(os.path.join(checkpoint_dir, d, METADATA)):
            continue
        if not d.startswith("."):
            tags.add(d)
        elif d.endswith(".previous") and not os.path.isdir(os.path.join(checkpoint_dir, d[1:-len(".previous")])):
            tags.add(d[1:-len(".previous")])
    return sorted(tags)


def _check_tag(tag: str) -> None:
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"tag {tag!r} is not a plain directory name (no '/', no leading '.', not "
                              f"'{LATEST}')")


def _commit(partial: str, final: str) -> None:
    """Move the complete `partial` directory to `final`; at every instant a complete checkpoint is findable."""
    previous = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.previous")
    if os.path.exists(final) and os.path.exists(previous):
        shutil.rmtree(previous)           # left by a crash after an earlier commit: final is the live one
    if os.path.exists(final):
        os.rename(final, previous)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(final))
    shutil.rmtree(previous, ignore_errors=True)


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


# -- RNG ----------------------------------------------------------------------------------------------------

def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save -----------------------------------------------------------------------------------------------------

def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None,
         save_latest: bool = True) -> str:
    """Every rank writes its shard of DIR/TAG, rank 0 the metadata; returns DIR/TAG. Call it on every rank.

    `tag` defaults to "global_step{N}" (DeepSpeed's default). `client_state` is any dict torch.load(weights_only=
    True) can read back (numbers, strings, tensors, lists): `load` returns it, e.g. for a data loader's position.
    """
    if engine.micro_step % engine.accum:
        raise CheckpointError(f"save_checkpoint at micro-step {engine.micro_step} is in the middle of gradient "
                              f"accumulation ({engine.accum} micro-steps per step): the partial gradients would be "
                              "lost. Save right after the engine.step() that completes an optimizer step.")
    if client_state is not None and not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    tag = tag or f"global_step{engine.global_step}"
    _check_tag(tag)
    engine.wait()
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, f".{tag}.partial")
    rank = engine.rank

    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)   # left by a crashed save
            os.makedirs(partial)
        except OSError as e:
            error = f"cannot create {partial}: {e}"
    _raise_first(_gather(engine, error), "save_checkpoint")

    info: dict | None = None
    error = None
    try:
        master = _master(engine)
        states = _optimizer_state(engine)
        elem, scalars = _split_state(states, master)
        extras = _extras(engine) if rank == 0 else {}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
        shard = {
            "format": FORMAT, "rank": rank, "world_size": engine.world_size,
            "master": _my_shard(engine, [m.float() for m in master]),
            "optimizer": {k: _my_shard(engine, [s[k] for s in states]) for k in elem},
            "optimizer_scalars": scalars, "param_groups": groups,
            "rng": _rng_state(), "client_state": dict(client_state or {}),
            "extras": {k: v.clone() for k, v in extras.items()},
        }
        name = f"rank{rank}.pt"
        f = os.path.join(partial, name)
        _write_checked(f, lambda fh: torch.save(shard, fh))
        info = {"name": name, "rank": rank, "bytes": os.path.getsize(f), "sha256": _sha256(f),
                "tensor_bytes": sum(t.numel() * t.element_size() for t in [shard["master"], *shard["optimizer"]
                                                                         .values()])}
    except Exception as e:   # every rank learns of it below, instead of waiting forever for this one
        error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    results = _gather(engine, (error, info))
    _raise_first([e for e, _ in results], "save_checkpoint", partial if rank == 0 else None)

    error = None
    if rank == 0:
        try:
            meta = _metadata(engine, tag, [i for _, i in results], elem, scalars, extras)
            _write_checked(os.path.join(partial, METADATA),
                           lambda fh: fh.write(json.dumps(meta, indent=1).encode()))
            _fsync_dir(partial)
            _commit(partial, final)
            if save_latest:
                _write_atomic(os.path.join(save_dir, LATEST), lambda fh: fh.write(tag.encode()))
        except Exception as e:
            error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    # nobody returns before the checkpoint exists
    _raise_first(_gather(engine, error), "save_checkpoint", partial if rank == 0 else None)
    return final


# -- load -----------------------------------------------------------------------------------------------------

def _read_for_rank(engine, path: str, meta: dict, load_optimizer_states: bool) -> dict:
    """Everything this rank needs, read and checked, in new tensors; the engine is not touched."""
    _check_model(meta, engine, path)
    elem = meta["optimizer"]["state_keys"] if load_optimizer_states else []
    if load_optimizer_states and meta["optimizer"]["type"] != type(engine.optimizer).__name__:
        raise CheckpointError(f"{os.path.join(path, METADATA)}: the checkpoint holds {meta['optimizer']['type']} "
                              f"state, this engine uses {type(engine.optimizer).__name__}. Configure the same "
                              "optimizer, or pass load_optimizer_states=False to load the weights only.")
    src = _Layout.of(meta)
    master = _master(engine)
    dst = {k: [torch.zeros(m.numel(), dtype=torch.float32) for m in master] for k in ["master", *elem]}
    plan: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(src.world_size)}
    for i, (b, m) in enumerate(zip(engine.layout.buckets, master, strict=True)):
        lo = _window(engine, b, m)
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
        _check_file(path, meta["files"][r])
    out: dict = {"tensors": dst}
    for r in needed:
        data = _open_shard(path, meta["files"][r], meta, checked=r in checked)
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
    _restore(engine, tensors["master"], state)
    with engine.comm.in_phase("init"):
        engine.publish()                                # compute parameters from the master weights
        engine.wait()
    current = _extras(engine)
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
        _set_rng_state(new["rng"])


# -- consolidation ---------------------------------------------------------------------------------------------

def consolidate(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """One fp32 state_dict of the whole model from a sharded checkpoint (DeepSpeed's zero_to_fp32.py).

    The result loads into the unwrapped model with `model.load_state_dict(sd)`: every name of a tied weight,
    and the buffers. Shards are read one at a time (memory-mapped), so the host needs the consolidated model
    plus at most one shard.
    """
    path = resolve(checkpoint_dir, tag)
    meta = read_metadata(path)
    src = _Layout.of(meta)
    flat = {p["name"]: torch.zeros(int(np.prod(p["shape"], dtype=np.int64)), dtype=torch.float32)
            for p in meta["parameters"]}
    plan: dict[int, list] = {r: [] for r in range(src.world_size)}
    for name, t in flat.items():
        for r, s, e, n in src.runs(name, 0, t.numel()):
            plan[r].append((t, e, s, n))
    extras: dict[str, torch.Tensor] = {}
    for r in range(src.world_size):
        data = _open_shard(path, meta["files"][r], meta)
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
    _write_atomic(args.output, lambda fh: torch.save(sd, fh))
    print(f"wrote {args.output}: {len(sd)} tensors, {meta['numel']:,} parameters in fp32 "
          f"({os.path.getsize(args.output):,} bytes), from stage {meta['stage']} on {meta['world_size']} rank(s) "
          f"at global step {meta['global_step']}")
    return 0
