"""What a zeroedu checkpoint is on disk, and the checks that a folder holds one.

The names (DIR/TAG/metadata.json, DIR/TAG/rank{r}.pt, DIR/latest), the metadata's check of its own content,
where each parameter element lives in the old shards (`Layout`), and the checks every shard file passes before
anything is read from it: a plain file inside the checkpoint folder, the size and sha256 that the metadata
recorded, and contents that match the metadata. `resolve` finds a checkpoint by its tag. zeroedu.checkpoint
describes the format as a whole and saves and loads with these.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

FORMAT = "zeroedu-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the problem."""

    __module__ = "zeroedu.checkpoint"   # its public name, zeroedu.checkpoint.CheckpointError, as tracebacks print it


# -- the metadata ---------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """Where each parameter element sits in the shards of a saved checkpoint."""

    world_size: int
    buckets: list[dict]
    params: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: dict) -> Layout:
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


def self_hash(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


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
    if meta.get("metadata_sha256") != self_hash(meta):
        raise CheckpointError(f"{f} was modified after it was saved: its metadata_sha256 does not match its "
                              "content. Restore the original file.")
    files = meta.get("files")
    if not isinstance(files, list) or not all(isinstance(i, dict) for i in files):
        raise CheckpointError(f"{f}: \"files\" is not a list of shard entries: the metadata was crafted or damaged")
    for info in files:
        _shard_path(path, info)   # every path checked before any shard is opened
    _check_fields(meta, path)
    return meta


def _int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _check_fields(meta: dict, path: str) -> None:
    """Every field that load and consolidate use, checked for type and against the others and the shards' sizes,
    before anything is allocated. A metadata.json whose self-hash was recomputed after an edit is as readable as
    a saved one, so a crafted world_size 0, a missing field or a 40 GB shape must be refused here, by name, not
    found as a ZeroDivisionError, a KeyError, an empty consolidated file or an allocation."""
    f = os.path.join(path, METADATA)

    def refuse(what: str) -> NoReturn:
        raise CheckpointError(f"{f}: {what}. The metadata was crafted or damaged (its hash only shows it was not "
                              "edited by accident); use a checkpoint as zeroedu saved it.")

    ws, files = meta.get("world_size"), meta["files"]
    if not _int(ws, 1):
        refuse(f"world_size is {ws!r}, not an int >= 1")
    if len(files) != ws:
        refuse(f"it lists {len(files)} shard file(s) for world_size {ws}")
    for r, info in enumerate(files):
        if info.get("rank") != r or not _int(info.get("bytes")) or not isinstance(info.get("sha256"), str):
            refuse(f"shard entry {r} is {info!r:.100}, not {{name, rank: {r}, bytes, sha256}}")
    for key in ("stage", "global_step", "micro_step", "skipped_steps", "numel", "full_numel", "shard_numel"):
        if not _int(meta.get(key)):
            refuse(f"{key} is {meta.get(key)!r}, not an int >= 0")
    if meta["stage"] > 3 or not _int(meta.get("gradient_accumulation_steps"), 1):
        refuse(f"stage {meta['stage']} / gradient_accumulation_steps {meta.get('gradient_accumulation_steps')!r} "
               "are out of range")
    opt = meta.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str) or not _strs(opt.get("state_keys")):
        refuse("optimizer is not {type, state_keys}")
    if meta.get("precision") not in ("fp32", "bf16", "fp16") or not isinstance(meta.get("loss_scaler"), dict):
        refuse(f"precision {meta.get('precision')!r} or loss_scaler is not what zeroedu writes")
    if meta["precision"] == "fp16" and not all(isinstance(meta["loss_scaler"].get(k), int | float) for k in
                                               ("scale", "hysteresis_left", "clean_steps")):
        refuse("loss_scaler lacks scale, hysteresis_left or clean_steps")
    if meta.get("lr_scheduler") is not None and not isinstance(meta["lr_scheduler"], dict):
        refuse("lr_scheduler is not a dict")
    # The layout: buckets back to back, each padded to a multiple of world_size, the shard their pieces.
    buckets, start, shard = meta.get("buckets"), 0, 0
    if not isinstance(buckets, list) or not buckets:
        refuse("buckets is not a non-empty list")
    for i, b in enumerate(buckets):
        if not isinstance(b, dict) or not all(_int(b.get(k)) for k in ("numel", "padded", "start", "shard_start")) \
                or b["padded"] % ws or b["numel"] > b["padded"] or b["start"] != start or b["shard_start"] != shard:
            refuse(f"bucket {i} is {b!r:.100}: not where the buckets before it end, or not padded to a multiple of "
                   f"world_size {ws}")
        start, shard = start + b["padded"], shard + b["padded"] // ws
    if meta["shard_numel"] != shard or meta["full_numel"] != start:
        refuse(f"shard_numel {meta['shard_numel']} / full_numel {meta['full_numel']} do not add up from the buckets "
               f"({shard} / {start})")
    params, names, numel = meta.get("parameters"), set(), 0
    if not isinstance(params, list) or not params:
        refuse("parameters is not a non-empty list")
    for p in params:
        ok = isinstance(p, dict) and isinstance(p.get("name"), str) and p["name"] not in names and \
            isinstance(p.get("shape"), list) and all(_int(d) for d in p["shape"]) and _strs(p.get("aliases")) and \
            _int(p.get("bucket")) and p["bucket"] < len(buckets) and _int(p.get("offset"))
        n = math.prod(p["shape"]) if ok else 0
        if not ok or p["offset"] + n > buckets[p["bucket"]]["numel"]:
            refuse(f"parameter entry {p!r:.120} does not fit the buckets")
        names.update([p["name"], *p["aliases"]])
        numel += n
    if numel != meta["numel"]:
        refuse(f"the parameters hold {numel} elements, numel says {meta['numel']}")
    keys = meta.get("state_dict_keys")
    if not _strs(keys) or not names <= set(keys):
        refuse(f"state_dict_keys does not list every parameter (missing: {sorted(names - set(keys or []))[:3]})")
    extras = meta.get("extras")
    if not isinstance(extras, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str) and
                                               isinstance(e.get("shape"), list) for e in extras):
        refuse("extras is not a list of {name, shape, dtype}")
    # What consolidate allocates must be in the files: each shard holds shard_numel fp32 elements per state (the
    # master weights and each optimizer state); consolidate compares the recorded sizes with the files on disk
    # before allocating (load allocates only what the engine's own model needs, after checking the model).
    need = meta["shard_numel"] * 4 * (1 + len(opt["state_keys"]))
    for info in files:
        if info["bytes"] < need:
            refuse(f"shard {info['name']} is recorded as {info['bytes']} bytes, less than the {need} bytes of "
                   "tensors the layout says it holds")



# -- the files ------------------------------------------------------------------------------------------------

def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def check_size(f: str, info: dict) -> None:
    """The file has the size the metadata recorded (a stat: checked before anything that size is allocated)."""
    size = os.path.getsize(f)
    if size < info["bytes"]:
        raise CheckpointError(f"{f} is truncated: {size} bytes, {METADATA} says {info['bytes']}. The copy or the "
                              "save did not finish.")
    if size > info["bytes"]:
        raise CheckpointError(f"{f} is larger than {METADATA} says ({size} bytes, not {info['bytes']}): it was "
                              f"overwritten, or {METADATA} comes from another checkpoint.")


def check_file(path: str, info: dict) -> str:
    """The file exists and has the size and sha256 that the metadata recorded; returns its path."""
    f = _shard_path(path, info)
    if not os.path.exists(f):
        raise CheckpointError(f"{f} is missing: {METADATA} lists it (rank {info['rank']}'s shard), so the "
                              "checkpoint is incomplete. Copy the whole checkpoint directory.")
    check_size(f, info)
    digest = file_sha256(f)
    if digest != info["sha256"]:
        raise CheckpointError(f"{f} was modified or corrupted after it was saved: its sha256 is {digest[:16]}..., "
                              f"{METADATA} says {info['sha256'][:16]}... (or {METADATA} comes from another "
                              "checkpoint)")
    return f


def open_shard(path: str, info: dict, meta: dict, checked: bool = False) -> dict:
    """torch.load one rank file after checking it against the metadata; raise CheckpointError naming it."""
    f = _shard_path(path, info) if checked else check_file(path, info)
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


# -- finding a checkpoint by its tag ------------------------------------------------------------------------

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
    check_tag(tag)
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


def check_tag(tag: str) -> None:
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise CheckpointError(f"tag {tag!r} is not a plain directory name (no '/', no leading '.', not "
                              f"'{LATEST}')")
