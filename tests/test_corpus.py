"""Real-world DeepSpeed configs (tests/deepspeed_corpus.py, each with its source) load and train 3 steps at world
size 2, or fail with one error that names every key zeroedu does not run, each with its fix; after the fix a
learner would make, they train."""

from __future__ import annotations

import pytest
from deepspeed_corpus import CORPUS, runnable

import zeroedu
from zeroedu.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(600)


def test_corpus_is_real_and_large_enough():
    assert len(CORPUS) >= 10
    assert all(e["source"].startswith("https://") for e in CORPUS.values())


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_one_error_names_every_refused_key(name):
    entry = CORPUS[name]
    if not entry["refused"]:
        load_config(entry["config"])
        return
    with pytest.raises(ConfigError) as e:
        load_config(entry["config"])
    message = str(e.value)
    for key in entry["refused"]:
        assert f"'{key}'" in message, (key, message)
    if len(entry["refused"]) > 1:
        assert message.startswith(f"{len(entry['refused'])} problems in this config")


def test_deepspeed_refuses_the_zero_sections_zeroedu_refuses():
    """The typos and the zero bucket size are not zeroedu's strictness: DeepSpeed 0.19.8's own ZeRO config model
    rejects them too."""
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    for name in ("hf-zero3", "megatron-zero3", "zero-infinity"):
        with pytest.raises(Exception, match="greater than 0|Extra inputs are not permitted"):
            zero_config.DeepSpeedZeroConfig(**CORPUS[name]["config"]["zero_optimization"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from graduation_workers import corpus_train

    nvme = str(tmp_path_factory.mktemp("nvme"))
    runs = {name: (runnable(name, nvme), CORPUS[name].get("client_optimizer")) for name in sorted(CORPUS)
            if "fix" in CORPUS[name] or not CORPUS[name]["refused"]}
    return runs, zeroedu.launch(corpus_train, world_size=2, args=(runs,), timeout=550)


def test_every_runnable_config_trains_three_steps(trained):
    runs, results = trained
    assert len(runs) >= 9
    for name in runs:
        for rank in results:
            r = rank[name]
            assert len(r["losses"]) == 3 and all(loss == loss and loss < 10 for loss in r["losses"]), (name, r)
        a, b = (rank[name] for rank in results)
        assert a["losses"] == b["losses"] and a["lrs"] == b["lrs"], name   # every rank takes the same step
    # The batch keys as written: QANet's 512 = 32 x accumulation x 2 ranks, CIFAR's 4 = 2 x 1 x 2.
    assert results[0]["qanet-onecycle"]["batch"] == [32, 8, 512]
    assert results[0]["cifar"]["batch"] == [2, 1, 4]
    # Logging keys print on rank 0: Megatron's steps_per_print 1, ZeRO-Infinity's wall_clock_breakdown.
    assert sum(line.startswith("step=") and "skipped=" in line for line in results[0]["megatron-zero2"]["lines"]) == 3
    assert sum("time (ms) | fwd:" in line for line in results[0]["zero-infinity"]["lines"]) == 3
    assert any("'aio' tunes libaio" in line for line in results[0]["zero-infinity"]["lines"])


def test_deprecated_cpu_offload_is_mapped_as_deepspeed_maps_it():
    c = load_config(CORPUS["megatron-zero2-offload"]["config"])
    assert c.zero_optimization.offload_optimizer.device == "cpu"
    assert any("'zero_optimization.cpu_offload' is deprecated in DeepSpeed" in n for n in c.notes)
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    theirs = zero_config.DeepSpeedZeroConfig(**CORPUS["megatron-zero2-offload"]["config"]["zero_optimization"])
    assert theirs.offload_optimizer is not None and theirs.offload_optimizer.device == "cpu"


# The new projects' configs that DeepSpeed 0.19.8 runs on CPU ranks as the Trainer fills them: no offload (its CPU
# Adam is a C++ build) and a torch optimizer (a client's, or torch_adam; its FusedAdam is a C++ build too).
ON_CPU = ["chatglm-ptuning", "open-instruct-z3", "ms-swift-zero3"]


@pytest.mark.slow
def test_new_projects_train_as_deepspeed_trains_them():
    from graduation_workers import corpus_both

    pytest.importorskip("deepspeed")
    runs = {name: (runnable(name), CORPUS[name].get("client_optimizer")) for name in ON_CPU}
    r = zeroedu.launch(corpus_both, world_size=2, args=(runs,), timeout=550)[0]
    for name in ON_CPU:
        ours, theirs = r[("zeroedu", name)], r[("deepspeed", name)]
        assert ours[0] == theirs[0], name   # the same model and batch: the first loss to the last bit
        assert ours == pytest.approx(theirs, rel=2e-2 if runs[name][0].get("bf16", {}).get("enabled") else 1e-5), \
            (name, ours, theirs)
