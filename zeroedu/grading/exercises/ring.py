"""Test harness for exercise 2: a learner's ring collectives, run on real gloo ranks, against torch's own.

    rs = run_reduce_scatter(ring_reduce_scatter, sizes=[8, 13, 1001])   # one launch, every size, both modes
    rs.check_sum(); rs.check_average(); rs.check_bytes()                 # raise AssertionError with a hint

Conventions the learner's functions follow (the exercise notebook states them):
- chunk c of a flat tensor of S elements is `tensor.tensor_split(N)[c]` (sizes differ by at most one);
- `ring_reduce_scatter(tensor, average=False)` returns this rank's chunk of the sum (or mean) over ranks;
- `ring_all_gather(shard, numel)` returns the full tensor of `numel` elements, shard r being this rank's chunk;
- `ring_all_reduce(tensor)` returns the sum over ranks, built from the two above.

Every rank builds integer-valued inputs from a seed, so sums are exact in any order. The reference is the sum
(or concatenation) of every rank's input, computed where the checks run -- under `zeroedu grade`, in the
grader's process, never in the ranks the learner's code shares. Bytes sent are counted with SendCounter around
the learner's call only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroedu.grading.exercises.ranks import SendCounter, not_implemented, ring_hang_hint, run_on_ranks
from zeroedu.grading.remote import in_kernel, wire_problem
from zeroedu.i18n import tr

__all__ = ["RingRun", "chunk_sizes", "run_all_gather", "run_all_reduce", "run_reduce_scatter"]


def chunk_sizes(numel: int, n: int) -> list[int]:
    """Element counts of tensor.tensor_split(n): the first numel % n chunks have one element more."""
    q, r = divmod(numel, n)
    return [q + 1] * r + [q] * (n - r)


def _values(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _returned(x: Any) -> Any:
    """What the learner returned, in a form that travels back to the parent."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return f"<{type(x).__name__}>"


def _job(rank: int, n: int, op: str, fn: Callable, cases: list[tuple[int, str]]) -> list[dict]:
    """On each rank: the learner's function on this rank's input, what it returned and sent. No reference is
    computed here: the learner's code shares these processes, so the grader builds the expected values itself."""
    rows = []
    for numel, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        seed = 1000 * numel + 17
        if op == "all_gather":
            shard = _values(seed, numel, dtype).tensor_split(n)[rank].clone()
            with SendCounter() as c:
                got = fn(shard, numel)
            rows.append(dict(numel=numel, dtype=dtype_name, average=False, got=_returned(got), sent=c.sent,
                             collectives=c.collectives))
            continue
        x = _values(seed + rank, numel, dtype)
        for average in ((False, True) if op == "reduce_scatter" else (False,)):
            with SendCounter() as c:
                got = fn(x.clone(), average=average) if op == "reduce_scatter" else fn(x.clone())
            rows.append(dict(numel=numel, dtype=dtype_name, average=average, got=_returned(got), sent=c.sent,
                             collectives=c.collectives))
    return rows


def _expected(op: str, n: int, rank: int, row: dict) -> dict:
    """What rank `rank` should have returned for `row`, built from the seeded inputs of every rank (exact: the
    inputs are small integers, so any order of summation gives the same floats)."""
    numel, dtype = row["numel"], getattr(torch, row["dtype"])
    seed = 1000 * numel + 17
    if op == "all_gather":
        full = _values(seed, numel, dtype)
        return dict(want=full, own=full.tensor_split(n)[rank].clone(), total=full)
    inputs = [_values(seed + r, numel, dtype) for r in range(n)]
    total = torch.stack(inputs).sum(dim=0)
    want = total.tensor_split(n)[rank].clone() if op == "reduce_scatter" else total
    if row["average"]:
        want = want / n
    return dict(want=want, own=inputs[rank].tensor_split(n)[rank].clone(), total=total)


def _collect(op: str, fn: Callable, cases: list[tuple[int, str]], world_size: int) -> dict:
    """In the kernel: the per-rank rows, or the launch's failure in plain words."""
    try:
        return {"rows": run_on_ranks(_job, world_size, args=(op, fn, cases), what=getattr(fn, "__name__", op),
                                     hang_hint=ring_hang_hint())}
    except AssertionError as e:
        return {"error": str(e)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6)


@dataclass
class RingRun:
    """The outcome of one launch: per rank, per case, what the learner's function returned and sent."""

    op: str
    name: str
    world_size: int
    rows: list[list[dict]] = field(default_factory=list)   # [rank][case]
    error: str | None = None

    # -- checks ------------------------------------------------------------------------------------------------
    def _ran(self) -> None:
        if self.error:
            raise AssertionError(self.error)

    def _cases(self, average: bool | None = None):
        for rank, rows in enumerate(self.rows):
            for row in rows:
                if average is None or row["average"] == average:
                    yield rank, row

    def check_sum(self) -> None:
        """Values and shapes equal torch's result on every rank and size (average=False)."""
        self._ran()
        for rank, row in self._cases(average=False):
            self._check_row(rank, row)

    def check_average(self) -> None:
        """reduce-scatter(average=True): the sum divided by N."""
        self._ran()
        for rank, row in self._cases(average=True):
            self._check_row(rank, row)

    def check_values(self) -> None:
        self._ran()
        for rank, row in self._cases():
            self._check_row(rank, row)

    def _check_row(self, rank: int, row: dict) -> None:
        n, got, want, numel = self.world_size, row["got"], row["want"], row["numel"]
        call = f"{self.name}({numel} element{'s' * (numel != 1)} of {row['dtype']}"
        call += ", average=True)" if row["average"] else ")"
        where = tr(f"on rank {rank} of {n}, {call}", f"在 {n} 个 rank 中的 rank {rank} 上，{call}")
        if not isinstance(got, torch.Tensor):
            raise AssertionError(tr(f"{where} returned {got}, not a tensor: return the result as a torch.Tensor.",
                                    f"{where} 返回了 {got}，不是张量：请把结果作为 torch.Tensor 返回。"))
        if got.dtype != want.dtype:
            raise AssertionError(tr(f"{where} returned {got.dtype}, the input is {want.dtype}: allocate buffers "
                                    "with the input's dtype (torch.empty_like, tensor.new_empty).",
                                    f"{where} 返回的是 {got.dtype}，输入是 {want.dtype}：缓冲区要用输入的 dtype 分配"
                                    "（torch.empty_like、tensor.new_empty）。"))
        if got.numel() != want.numel():
            shifted = self._shifted(rank, row, got)
            if shifted:
                raise AssertionError(f"{where} {shifted}")
            if self.op == "reduce_scatter" and got.numel() == numel:
                raise AssertionError(tr(f"{where} returned all {numel} elements; a reduce-scatter returns only "
                                        f"this rank's chunk: chunk {rank} of tensor.tensor_split({n}), "
                                        f"{want.numel()} elements.",
                                        f"{where} 返回了全部 {numel} 个元素；reduce-scatter 只返回本 rank 的那一块："
                                        f"tensor.tensor_split({n}) 的第 {rank} 块，{want.numel()} 个元素。"))
            raise AssertionError(tr(f"{where} returned {got.numel()} elements, expected {want.numel()}"
                                    f" (chunk sizes for {numel} elements on {n} ranks: {chunk_sizes(numel, n)}).",
                                    f"{where} 返回了 {got.numel()} 个元素，应为 {want.numel()}"
                                    f"（{numel} 个元素在 {n} 个 rank 上的分块大小：{chunk_sizes(numel, n)}）。"))
        got = got.reshape(want.shape)
        if _close(got, want):
            return
        raise AssertionError(where + " " + self._diagnose(rank, row, got))

    def _diagnose(self, rank: int, row: dict, got: torch.Tensor) -> str:
        n, want = self.world_size, row["want"]
        if row["average"] and _close(got, want * n):
            return tr("returned the sum, not the mean: with average=True divide by the number of ranks N.",
                      "返回的是总和而不是平均值：average=True 时要除以 rank 数 N。")
        if not row["average"] and self.op == "reduce_scatter" and _close(got * n, want):
            return tr("divided by N although average=False: return the plain sum.",
                      "average=False 时却除以了 N：请返回直接求和的结果。")
        if self.op == "reduce_scatter":
            shifted = self._shifted(rank, row, got)
            if shifted:
                return shifted
            scale = n if row["average"] else 1
            if _close(got, row["own"]) or _close(got, row["own"] / scale):
                return tr("returned this rank's own chunk, not the sum: nothing from the other ranks was added.",
                          "返回的是本 rank 自己的那一块，不是总和：没有加上其他 rank 的数据。")
            return tr("returned values that are not the sum over all ranks: at each step add the partial sum you "
                      "received to this rank's own part of that chunk, and send the result on.",
                      "返回的值不是所有 rank 的总和：每一步要把收到的部分和加上本 rank 自己的那一块，再把结果发出去。")
        if self.op == "all_reduce":
            if _close(got, row["own"]):
                return tr("returned this rank's input unchanged: nothing was summed.",
                          "原样返回了本 rank 的输入：什么都没有求和。")
            return tr("did not return the sum over all ranks (compare: ring_reduce_scatter, then ring_all_gather).",
                      "返回的不是所有 rank 的总和（对照：先 ring_reduce_scatter，再 ring_all_gather）。")
        # all_gather: which chunks are wrong?
        bad = [c for c, (g, w) in enumerate(zip(got.tensor_split(n), want.tensor_split(n), strict=True))
               if not _close(g, w)]
        return tr(f"chunk(s) {bad} of the gathered tensor are wrong (chunk c must be rank c's shard). Check which "
                  "chunk you forward at each step: at step 0 your own, then the one that just arrived.",
                  f"收集到的张量中第 {bad} 块是错的（第 c 块必须是 rank c 的分片）。检查每一步转发的是哪一块："
                  "第 0 步发自己的，之后发刚收到的那一块。")

    def _shifted(self, rank: int, row: dict, got: torch.Tensor) -> str:
        """For a reduce-scatter that returned another rank's chunk of the sum: say so, and by how many steps."""
        if self.op != "reduce_scatter":
            return ""
        n = self.world_size
        scale = n if row["average"] else 1
        for c, chunk in enumerate(row["total"].tensor_split(n)):
            if c != rank and _close(got.reshape(-1), chunk / scale):
                return tr(f"returned chunk {c} of the sum, but rank {rank} must end with chunk {rank}: the ring "
                          f"schedule is off by {(c - rank) % n} step(s). Count which chunk each rank sends at step "
                          "0 and follow one chunk around the ring.",
                          f"返回的是总和的第 {c} 块，但 rank {rank} 最后应持有第 {rank} 块：ring 的调度偏了 "
                          f"{(c - rank) % n} 步。数一数第 0 步每个 rank 发的是哪一块，再跟着一块走完整个 ring。")
        return ""

    def check_bytes(self) -> None:
        """Each rank sends what a ring sends: (N-1)/N·S for reduce-scatter and all-gather, twice that for
        all-reduce; exactly when N divides S, and the same total over ranks for any S."""
        self._ran()
        n = self.world_size
        factor = 2 if self.op == "all_reduce" else 1
        by_case: dict[tuple, list[int]] = {}
        for rank, row in self._cases(average=False):
            if row["collectives"]:
                names = ", ".join(sorted(set(row["collectives"])))
                raise AssertionError(tr(f"{self.name} called a torch.distributed collective ({names}) on rank "
                                        f"{rank}: build it from point-to-point dist.isend/dist.irecv only.",
                                        f"{self.name} 在 rank {rank} 上调用了 torch.distributed 的集合通信（{names}）："
                                        "只能用点对点的 dist.isend/dist.irecv 来搭。"))
            elem = row["want"].element_size()
            numel = row["numel"]
            total_bytes = numel * elem
            theory = factor * (n - 1) * total_bytes / n
            sent = row["sent"]
            by_case.setdefault((numel, row["dtype"]), []).append(sent)
            if sent == 0 and n > 1 and numel >= n:
                raise AssertionError(tr(f"{self.name} sent no bytes point-to-point on rank {rank}: use dist.isend "
                                        "and dist.irecv (or dist.P2POp with dist.batch_isend_irecv).",
                                        f"{self.name} 在 rank {rank} 上没有点对点发送任何字节：请用 dist.isend 和 "
                                        "dist.irecv（或 dist.P2POp 配合 dist.batch_isend_irecv）。"))
            slack = factor * max(chunk_sizes(numel, n)) * elem if numel % n else 0
            if abs(sent - theory) > slack:
                chunks = sent / (total_bytes / n)
                if sent <= theory:
                    why = tr("Some chunk did not travel around the whole ring.", "有的块没有沿 ring 走完一整圈。")
                elif abs(sent - factor * (n - 1) * total_bytes) <= slack:
                    why = tr("That is the whole tensor at every step: send one chunk per step.",
                             "这相当于每一步都发了整个张量：每一步只发一块。")
                elif abs(chunks - round(chunks)) < 1e-6 and round(chunks) > factor * (n - 1):
                    extra = round(chunks) - factor * (n - 1)
                    why = tr(f"That is {extra} chunk(s) more than the ring's {factor * (n - 1)}: count the steps, a "
                             f"ring of N ranks takes N-1 = {n - 1}" + (" per phase." if factor == 2 else "."),
                             f"这比 ring 的 {factor * (n - 1)} 块多了 {extra} 块：数一数步数，N 个 rank 的 ring "
                             + ("每个阶段" if factor == 2 else "") + f"走 N-1 = {n - 1} 步。")
                else:
                    why = tr("Send exactly one chunk per step.", "每一步恰好发一块。")
                raise AssertionError(tr(
                    f"rank {rank} sent {sent} bytes for a {total_bytes}-byte tensor on {n} ranks; a ring sends "
                    f"{factor}·(N-1)/N·S = {theory:g} bytes: {factor * (n - 1)} step(s) of "
                    f"{'S/N, one chunk,' if sent > theory else 'one chunk (S/N)'} each. {why}",
                    f"{n} 个 rank 处理 {total_bytes} 字节的张量，rank {rank} 发送了 {sent} 字节；ring 应发送 "
                    f"{factor}·(N-1)/N·S = {theory:g} 字节：{factor * (n - 1)} 步，每步一块（S/N）。{why}"))
        for (numel, dtype), sent in by_case.items():
            total = factor * (n - 1) * numel * getattr(torch, dtype).itemsize
            if sum(sent) != total:
                raise AssertionError(tr(f"the {n} ranks sent {sum(sent)} bytes in all for {numel} elements of "
                                        f"{dtype}; a ring sends {factor}·(N-1)·S = {total}: each chunk travels N-1 "
                                        "hops.",
                                        f"{n} 个 rank 为 {numel} 个 {dtype} 元素一共发送了 {sum(sent)} 字节；"
                                        f"ring 应发送 {factor}·(N-1)·S = {total} 字节：每一块要走 N-1 跳。"))

    # -- display ----------------------------------------------------------------------------------------------
    def table(self) -> str:
        """Bytes each rank sent, next to the ring's (N-1)/N·S, one line per size."""
        if self.error:
            return tr(f"{self.name} did not run: {self.error}", f"{self.name} 没有跑起来：{self.error}")
        n = self.world_size
        factor = 2 if self.op == "all_reduce" else 1
        lines = [f"{self.name} on {n} ranks: bytes sent per rank vs {'2·' if factor == 2 else ''}(N-1)/N·S"]
        for i, row in enumerate(self.rows[0]):
            if row["average"]:
                continue
            sent = [self.rows[r][i]["sent"] for r in range(n)]
            s = row["numel"] * row["want"].element_size()
            k = "2·" if factor == 2 else ""
            lines.append(f"  S = {s:>6} B ({row['numel']} x {row['dtype']}): sent {sent}, theory "
                         f"{factor * (n - 1) * s / n:g}; all ranks {sum(sent)} = {k}(N-1)·S = {factor * (n - 1) * s}")
        return "\n".join(lines)


def _run(op: str, fn: Callable, probe_args: tuple, sizes: list[int], world_size: int, dtype: torch.dtype) -> RingRun:
    name = getattr(fn, "__name__", op)
    run = RingRun(op, name, world_size)
    stub = in_kernel(not_implemented, fn, *probe_args)
    if stub is not None:
        run.error = tr(f"not implemented yet: {stub}", f"尚未实现：{stub}")
        return run
    cases = [(int(s), str(dtype).removeprefix("torch.")) for s in sizes]
    out = in_kernel(_collect, op, fn, cases, world_size)
    if "error" in out:
        run.error = str(out["error"])
        return run
    claimed = sum(row["sent"] for rows in out["rows"] for row in rows
                  if isinstance(row, dict) and isinstance(row.get("sent"), int))
    problem = wire_problem(claimed, name, tr("counted by SendCounter", "由 SendCounter 统计"))
    if problem:
        run.error = problem
        return run
    run.rows = [[{**row, **_expected(op, world_size, rank, row)} for row in rows]
                for rank, rows in enumerate(out["rows"])]
    return run


def run_reduce_scatter(fn: Callable, sizes: list[int], world_size: int = 4,
                       dtype: torch.dtype = torch.float32) -> RingRun:
    """Run fn(tensor, average=...) on world_size ranks for each size, with average False and True."""
    return _run("reduce_scatter", fn, (torch.zeros(8),), sizes, world_size, dtype)


def run_all_gather(fn: Callable, sizes: list[int], world_size: int = 4, dtype: torch.dtype = torch.float32) -> RingRun:
    """Run fn(shard, numel) on world_size ranks for each size."""
    return _run("all_gather", fn, (torch.zeros(2), 8), sizes, world_size, dtype)


def run_all_reduce(fn: Callable, sizes: list[int], world_size: int = 4, dtype: torch.dtype = torch.float32) -> RingRun:
    """Run fn(tensor) on world_size ranks for each size."""
    return _run("all_reduce", fn, (torch.zeros(8),), sizes, world_size, dtype)
