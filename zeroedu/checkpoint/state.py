"""What a checkpoint takes from an engine and puts back, through the engine protocol's checkpoint hooks.

The engine side of a save: every trained parameter's name, shape, bucket and offset (`_param_entries`), the
buffers (`extra_state`), the fp32 master pieces and the optimizer state (`checkpoint_master`,
`checkpoint_optimizer_state`), cut into this rank's shard; the metadata that describes the engine; and the RNG
states. The engine side of a load: the check that a checkpoint describes this engine's model, and
`restore_checkpoint`.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch

from zeroedu.checkpoint.fileformat import FORMAT, FORMAT_VERSION, METADATA, CheckpointError, self_hash

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


def extra_state(engine) -> dict[str, torch.Tensor]:
    """What the module's state_dict holds besides the trained parameters: buffers, frozen parameters."""
    trained = {n for e in _param_entries(engine) for n in [e["name"], *e["aliases"]]}
    return {k: v.detach() for k, v in engine.module.state_dict().items() if k not in trained}


def master_weights(engine) -> list[torch.Tensor]:
    return engine.checkpoint_master()


def optimizer_state(engine) -> list[dict]:
    return engine.checkpoint_optimizer_state()


def restore(engine, master: list[torch.Tensor], state: list[dict] | None) -> None:
    engine.restore_checkpoint(master, state)


def window(engine, b, piece: torch.Tensor) -> int:
    """Where a master piece starts inside its bucket: 0 if it is the whole bucket (stage 0), else rank x piece."""
    if piece.numel() == b.padded:
        return 0
    if piece.numel() != b.piece:
        raise CheckpointError(f"bucket {b.index}: master piece has {piece.numel()} elements, expected {b.piece} "
                              f"(this rank's piece) or {b.padded} (the whole bucket)")
    return engine.rank * b.piece


def my_shard(engine, tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's piece of every bucket, back to back (a new tensor), from per-bucket pieces or whole buckets."""
    parts = []
    for b, t in zip(engine.layout.buckets, tensors, strict=True):
        window(engine, b, t)   # checks the size
        lo = engine.rank * b.piece if t.numel() == b.padded else 0
        parts.append(t.reshape(-1)[lo: lo + b.piece])
    return torch.cat(parts).to("cpu")


def split_state(states: list[dict], master: list[torch.Tensor]):
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


# -- the metadata ---------------------------------------------------------------------------------------------

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


def build_metadata(engine, tag: str, files: list[dict], elem: list[str], scalars: dict, extras: dict) -> dict:
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
        "config": engine.config.resolved(),   # every key as the run used it, the `zeroedu` knobs included
    }
    meta["metadata_sha256"] = self_hash(meta)
    return meta


def check_model(meta: dict, engine, path: str) -> None:
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
    extras = extra_state(engine)
    for e in meta["extras"]:
        if e["name"] not in extras or list(extras[e["name"]].shape) != e["shape"]:
            have = list(extras[e["name"]].shape) if e["name"] in extras else "absent"
            raise CheckpointError(f"{f}: buffer '{e['name']}' is {e['shape']} in the checkpoint, {have} in "
                                  "this model. Build the model the checkpoint was saved from.")


# -- RNG ----------------------------------------------------------------------------------------------------

def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
