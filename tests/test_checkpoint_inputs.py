"""Checkpoint inputs that would save something load refuses, crafted metadata, and outputs that cannot be
written: each gets an error naming the problem before anything is allocated or written (issue 36, items 3, 6, 7).

A world of one in this process (initialize() outside launch) is enough: what is checked here is the files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zeroedu
from zeroedu import checkpoint
from zeroedu.checkpoint import CheckpointError
from zeroedu.models import MLP

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine():
    engine, *_ = zeroedu.initialize(model=MLP(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}})
    engine.backward(engine(torch.randn(2, 32)).square().mean())
    engine.step()
    return engine


def test_client_state_with_numpy_values_is_refused_naming_the_key(engine, tmp_path):
    state = {"epoch": 3, "sampler": {"seen": [1, 2, np.int64(5)]}}
    with pytest.raises(CheckpointError, match=r"client_state\['sampler'\]\['seen'\]\[2\] is numpy.int64"):
        engine.save_checkpoint(str(tmp_path), "t", client_state=state)
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()
    # what load accepts saves and comes back as it was
    ok = {"epoch": 3, "sampler": {"seen": [1, 2, 5], "rng": torch.arange(3)}}
    engine.save_checkpoint(str(tmp_path), "t", client_state=ok)
    _, back = engine.load_checkpoint(str(tmp_path), "t")
    assert back["epoch"] == 3 and back["sampler"]["seen"] == [1, 2, 5]
    assert torch.equal(back["sampler"]["rng"], torch.arange(3))


def _rehash(meta_file: Path, edit) -> None:
    """Edit a metadata.json and make its self-hash match again, as anyone crafting one can."""
    meta = json.loads(meta_file.read_text())
    edit(meta)
    body = {k: v for k, v in meta.items() if k != "metadata_sha256"}
    meta["metadata_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    meta_file.write_text(json.dumps(meta))


def _param(i: int):
    return lambda m: m["parameters"][i]


CRAFTED = {   # name -> an edit of the metadata, each found by the probe as a raw error or worse
    "world_size 0": lambda m: m.update(world_size=0),                                   # ZeroDivisionError
    "a shard entry dropped": lambda m: m.update(files=m["files"][:0]),                   # IndexError
    "a parameter without its bucket": lambda m: _param(0)(m).pop("bucket"),              # KeyError
    "a bucket index out of range": lambda m: _param(0)(m).update(bucket=99),             # IndexError
    "a 40 GB shape": lambda m: _param(0)(m).update(shape=[100000, 100000]),              # the allocation
    "no state_dict_keys": lambda m: m.update(state_dict_keys=[]),                        # an empty file, exit 0
    "a 40 GB shard": lambda m: (m.update(shard_numel=10**10), m["buckets"][-1].update(padded=10**10)),
    "global_step a string": lambda m: m.update(global_step="7"),                         # loads, then crashes
    "an optimizer without state keys": lambda m: m["optimizer"].pop("state_keys"),
}


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    engine.save_checkpoint(str(d), "t")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_metadata_is_refused_before_anything_is_allocated_or_written(engine, saved, tmp_path, case):
    d = tmp_path / "ck"
    shutil.copytree(saved, d)
    _rehash(d / "t" / "metadata.json", CRAFTED[case])
    with pytest.raises(CheckpointError, match="crafted or damaged"):
        checkpoint.consolidate(str(d))
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    with pytest.raises(CheckpointError, match="crafted or damaged"):
        engine.load_checkpoint(str(d))
    after = engine.master_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the engine"
    # The command line: exit code 1, the reason, no output file; under a 3 GB address-space limit, so that an
    # allocation of the crafted size would fail with MemoryError instead of the reason.
    out = tmp_path / "sd.pt"
    run = subprocess.run(["bash", "-c", f"ulimit -v 3000000; exec {sys.executable} -m zeroedu consolidate {d} {out}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and "crafted or damaged" in run.stderr, (run.returncode, run.stderr[-2000:])
    assert not out.exists()


@pytest.mark.slow
def test_consolidate_into_a_read_only_folder_says_so(saved, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = f"{sys.executable} -m zeroedu consolidate {saved} {ro / 'sd.pt'}"
    if os.geteuid() == 0:   # root writes into a 0555 folder: mount a read-only filesystem there, privately
        if not shutil.which("unshare"):
            pytest.skip("root, and no unshare to mount a read-only folder")
        cmd = f"mount -t tmpfs -o ro none {ro} && {cmd}"
        argv = ["unshare", "-m", "bash", "-c", cmd]
    else:
        ro.chmod(0o555)
        argv = ["bash", "-c", cmd]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ro.chmod(0o755)
    if "mount:" in run.stderr:
        pytest.skip(f"cannot mount a read-only folder here: {run.stderr.strip()[:200]}")
    assert run.returncode == 1 and "cannot write" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not list(ro.iterdir())


def test_consolidate_of_a_good_checkpoint_still_works(engine, saved, tmp_path):
    sd = checkpoint.consolidate(str(saved))
    assert sd.keys() == engine.module.state_dict().keys()
