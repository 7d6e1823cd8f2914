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
import os
from dataclasses import dataclass, field

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
    return meta


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


def check_file(path: str, info: dict) -> str:
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
