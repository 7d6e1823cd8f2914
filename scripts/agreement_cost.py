"""What the per-step collective agreement check costs (zeroedu.comm.agreement), on the bench's TinyGPT.

In one launch, two engines of each stage take turns, one step each, the order alternating every round: one
checks agreement (the default), the other has it switched off. The cost is the geometric mean of the per-round
ratios (as `zeroedu bench` computes its ratios), plus the time spent inside the check's own code. A step lasts as
long as its slowest rank.

    PYTHONPATH=$PWD python scripts/agreement_cost.py [--rounds 30] [--world-size 2]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

import zeroedu
from zeroedu.bench.pairs import Workload, zeroedu_config


def _rank(rank: int, world: int, stages: list[int], rounds: int, warmup: int, mb: int) -> dict:
    work = Workload("gpt", 256, 4)
    out = {}
    for stage in stages:
        engines = {}
        for name in ("on", "off"):
            engine, *_ = zeroedu.initialize(model=work.model(), config=zeroedu_config(stage, mb))
            if name == "off":
                engine.comm.agreement = None
            engines[name] = engine
        inside = {"on": 0.0, "cpu": 0.0}
        check = engines["on"].comm.agreement.check

        def timed_check(*a, check=check, inside=inside, **kw):   # kw: finish()'s final=
            t0, c0 = time.perf_counter(), time.thread_time()
            check(*a, **kw)
            inside["on"] += time.perf_counter() - t0
            inside["cpu"] += time.thread_time() - c0
        engines["on"].comm.agreement.check = timed_check
        routing = getattr(getattr(engines["on"], "units", None), "routing", None)
        if routing is not None:   # stage 3 also asks before every gather (zeroedu.engine.stages.routing)
            inside.update(asks=0, gathers=0, ask_cpu=0.0, wait=0.0)
            ask = routing.ask

            def timed_ask(part, ask=ask, inside=inside, routing=routing):
                c0, asked = time.thread_time(), routing.count
                answer = ask(part)
                inside["asks"] += routing.count - asked   # 0 once the ranks stop asking (Agreement.watch_gathers)
                inside["gathers"] += 1
                inside["ask_cpu"] += time.thread_time() - c0

                def timed_answer() -> None:   # on the comm thread, just before the gather
                    t0, c1 = time.perf_counter(), time.thread_time()
                    answer()
                    inside["wait"] += time.perf_counter() - t0
                    inside["ask_cpu"] += time.thread_time() - c1
                return timed_answer
            routing.ask = timed_ask
        times = {"on": [], "off": []}
        for r in range(warmup + rounds):
            x, y = work.batch(r, mb * world)
            x, y = x[rank * mb:(rank + 1) * mb], y[rank * mb:(rank + 1) * mb]
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            for name in order:
                e = engines[name]
                dist.barrier()
                t0 = time.perf_counter()
                e.backward(work.loss(e(x), y))
                e.step()
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    times[name].append(float(t))
            if r == warmup - 1:
                inside.update({k: 0 for k in inside})
        ratio = math.exp(sum(math.log(a / b) for a, b in zip(times["on"], times["off"], strict=True)) / rounds)
        out[stage] = {"ratio": ratio, "on_ms": 1e3 * sorted(times["on"])[rounds // 2],
                      "off_ms": 1e3 * sorted(times["off"])[rounds // 2], "check_ms": 1e3 * inside["on"] / rounds,
                      "check_cpu_ms": 1e3 * inside["cpu"] / rounds, "asks": inside.get("asks", 0) / rounds,
                      "gathers": inside.get("gathers", 0) / rounds,
                      "ask_cpu_ms": 1e3 * inside.get("ask_cpu", 0.0) / rounds,
                      "ask_wait_ms": 1e3 * inside.get("wait", 0.0) / rounds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    a = ap.parse_args()
    res = zeroedu.launch(_rank, a.world_size, args=(a.stages, a.rounds, a.warmup, 4), timeout=1200)[0]
    print(f"TinyGPT (d_model 256, 4 layers, micro-batch 4), {a.world_size} ranks, {a.rounds} rounds, gloo on CPU")
    print("stage  step with check (median ms)  without  ratio (geo. mean)  in check() per step: wall, CPU")
    for stage, r in res.items():
        print(f"{stage:>5}  {r['on_ms']:>27.2f}  {r['off_ms']:>7.2f}  {r['ratio']:>17.4f}  {r['check_ms']:.3f} ms, "
              f"{r['check_cpu_ms']:.3f} ms")
    for stage, r in res.items():
        if r["gathers"]:
            print(f"stage {stage}: {r['gathers']:.0f} gathers per step, {r['asks']:.1f} of them asked about (after "
                  f"{a.warmup} warm-up steps); CPU in ask() {r['ask_cpu_ms']:.3f} ms, the comm thread's wait for "
                  f"the answers {r['ask_wait_ms']:.3f} ms")


if __name__ == "__main__":
    main()
