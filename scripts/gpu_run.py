"""The GPU numbers the course argues with, measured in one prepared run, written as JSON.

    PYTHONPATH=. python3 scripts/gpu_run.py --out docs/gpu            # on a machine with an NVIDIA GPU
    PYTHONPATH=. python3 scripts/gpu_run.py --dry --out out/gpu_dry   # anywhere: the same logic, tiny, on the CPU

It runs zeroedu from this source tree with whatever torch the machine has (no registry needed), and writes
`results.json` (`--dry`: `dry_run.json`) with the GPU's name, torch's version and the date. Sections, each
recorded even if another fails:

- tests: tests/test_gpu.py (stages 0-3 and CPU offload at world size 1 over NCCL against a CPU reference, the
  theory and the CUDA allocator), as counts of passed / failed / skipped;
- memory: per stage, a model big enough that model states dominate, trained a few steps at world size 1:
  torch.cuda.max_memory_allocated and memory_reserved next to zeroedu.theory and the engine's meter;
- offload: pinned host <-> device bandwidth, CPU Adam against the GPU's fused Adam (elements per second), and
  one training step with and without optimizer offload;
- checkpointing: a step with and without activation checkpointing (recompute cost as a fraction of the step),
  where zeroedu.checkpointing exists.

notebooks/90_appendix_gpu.ipynb loads the JSON and puts it next to the CPU course's numbers. The dry mode runs
every section's code on the CPU at toy sizes and marks what it could not measure there, so the logic is tested
(tests/test_gpu_run.py) before any GPU time is spent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

import zeroedu
from zeroedu import theory

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def sizes(dry: bool) -> dict:
    """Model and tensor sizes: the GPU's are big enough that model states dominate; the dry run's take seconds."""
    if dry:
        return {"mlp": (256,) * 5, "batch": 8, "adam_numel": 1 << 20, "copy_bytes": 16 << 20, "gpt_seq": 64}
    # 16 x Linear(4096, 4096): 268 M parameters, 4.3 GB of mixed-precision model states at world size 1
    return {"mlp": (4096,) * 17, "batch": 16, "adam_numel": 1 << 28, "copy_bytes": 1 << 30, "gpt_seq": 1024}


def config(stage: int, batch: int, offload: str = "none") -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}   # stage 3 keeps only its shard: theory's
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": torch.cuda.is_available()}
    return {"train_micro_batch_size_per_gpu": batch, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "bf16": {"enabled": True}, "zero_optimization": zero}


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_steps(engine, batches, loss_fn) -> list[float]:
    seconds = []
    for x, y in batches:
        x = x.to(engine.dtype) if x.is_floating_point() else x   # the model computes in bf16
        _sync()
        t0 = time.perf_counter()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        _sync()
        seconds.append(time.perf_counter() - t0)
    return seconds


def train_mlp(rank: int, world: int, stage: int, shape: tuple, batch: int, offload: str = "none") -> dict:
    """One rank: train the MLP a few steps; the allocator's figures, the meter's and the step times."""
    from zeroedu.models import MLP, mlp_batch, mlp_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) if cuda else 0
    model = MLP(shape, seed=0).to(device)
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zeroedu.initialize(model=model, config=config(stage, batch, offload))
    batches = [tuple(t.to(device) for t in mlp_batch(s, batch, shape)) for s in range(STEPS)]
    seconds = _timed_steps(engine, batches, mlp_loss)
    meter = engine.memory()
    return {
        "stage": stage, "offload": offload, "psi": psi, "step_seconds": seconds,
        "theory_model_states": theory.model_state_bytes(psi, world, stage, "bf16"),
        "meter_model_states": meter["model_states"], "meter_resident": meter["resident"],
        "cuda_max_allocated": torch.cuda.max_memory_allocated(device) - baseline if cuda else None,
        "cuda_reserved": torch.cuda.memory_reserved(device) if cuda else None,
    }


def section_tests(dry: bool, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]
    if dry:   # no CUDA: collect what would run, and say so
        done = subprocess.run([*cmd, "--collect-only"], capture_output=True, text=True, cwd=ROOT)
        collected = sum(1 for line in done.stdout.splitlines() if "::" in line)
        return {"skipped_reason": "dry run: needs CUDA", "collected": collected}
    junit = out / "junit_gpu.xml"
    done = subprocess.run([*cmd, "-rs", "--junitxml", str(junit)], capture_output=True, text=True, cwd=ROOT)
    suites = list(ET.parse(junit).getroot().iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return {**count, "exit_code": done.returncode, "tail": done.stdout[-3000:]}


def section_memory(dry: bool) -> dict:
    s = sizes(dry)
    return {f"stage {k}": zeroedu.launch(train_mlp, world_size=1, args=(k, s["mlp"], s["batch"]))[0]
            for k in range(4)}


def _bandwidth(nbytes: int) -> dict:
    """Host <-> device copies of one pinned buffer, bytes per second (the CPU: a memcpy between two tensors)."""
    cuda = torch.cuda.is_available()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    rates = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=cuda)   # warm-up
        _sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=cuda)
        _sync()
        rates[name] = 5 * nbytes / (time.perf_counter() - t0)
    return rates


def _adam_rate(numel: int, device: str, fused: bool) -> float:
    """Adam steps over `numel` fp32 elements: elements per second (median of 5 steps after a warm-up)."""
    p = torch.zeros(numel, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.Adam([p], lr=1e-4, fused=fused)
    times = []
    for _ in range(6):
        _sync()
        t0 = time.perf_counter()
        opt.step()
        _sync()
        times.append(time.perf_counter() - t0)
    return numel / sorted(times[1:])[2]


def section_offload(dry: bool) -> dict:
    s = sizes(dry)
    gpu = "cuda" if torch.cuda.is_available() else None
    steps = {name: zeroedu.launch(train_mlp, world_size=1, args=(2, s["mlp"], s["batch"], off))[0]
             for name, off in (("stage 2", "none"), ("stage 2 + offload_optimizer cpu", "cpu"))}
    return {
        "copy_bytes": s["copy_bytes"], "bytes_per_s": _bandwidth(s["copy_bytes"]),
        "cpu_threads": torch.get_num_threads(), "adam_numel": s["adam_numel"],
        "cpu_adam_elements_per_s": _adam_rate(s["adam_numel"], "cpu", fused=True),
        "gpu_fused_adam_elements_per_s": _adam_rate(s["adam_numel"], gpu, fused=True) if gpu else None,
        "steps": steps,
    }


def train_gpt(rank: int, world: int, seq: int, checkpointed: bool) -> dict:
    """One rank: TinyGPT at stage 3, its blocks recomputed in backward (zeroedu.checkpointing) or not."""
    from zeroedu.models import TinyGPT, TinyGPTConfig, gpt_batch, gpt_loss

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shape = TinyGPTConfig(seq_len=seq, d_model=256 if seq > 64 else 64, checkpoint_activations=checkpointed)
    engine, *_ = zeroedu.initialize(model=TinyGPT(shape, seed=0).to(device), config=config(3, 4))
    batches = [tuple(t.to(device) for t in gpt_batch(s, 4, shape)) for s in range(STEPS)]
    return {"step_seconds": _timed_steps(engine, batches, gpt_loss), "d_model": shape.d_model, "seq_len": seq}


def section_checkpointing(dry: bool) -> dict:
    seq = sizes(dry)["gpt_seq"]
    return {name: zeroedu.launch(train_gpt, world_size=1, args=(seq, on))[0]
            for name, on in (("plain", False), ("checkpointed", True))}


SECTIONS = {"tests": section_tests, "memory": section_memory, "offload": section_offload,
            "checkpointing": section_checkpointing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu")
    ap.add_argument("--dry", action="store_true", help="run every section's logic on the CPU at toy sizes")
    ap.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run these sections only")
    a = ap.parse_args(argv)
    if not a.dry and not torch.cuda.is_available():
        print("gpu_run: torch sees no GPU here; use --dry to run the logic on the CPU", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    result = {
        "dry_run": a.dry,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({cpu_name()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "sections": {},
    }
    target = a.out / ("dry_run.json" if a.dry else "results.json")
    for name in a.only or SECTIONS:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            result["sections"][name] = SECTIONS[name](a.dry) if name != "tests" else section_tests(a.dry, a.out)
        except Exception as e:   # keep what the other sections measured
            result["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
        result["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        target.write_text(json.dumps(result, indent=1, default=str) + "\n")   # after each section: a kill loses one
        print(json.dumps(result["sections"][name], default=str)[:400], flush=True)
    failed = [n for n, r in result["sections"].items() if "error" in r or r.get("failures") or r.get("errors")]
    print(f"gpu_run: wrote {target}; " + (f"problems in {failed}" if failed else "every section ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
