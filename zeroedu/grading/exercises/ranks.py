"""Running a learner's function on real ranks for a test, and saying in plain words what went wrong.

- `run_on_ranks(job, world_size, ...)` is zeroedu.launch with test-friendly failures: a rank that raised, ranks
  that hung, a launch that could not start all become an AssertionError whose message a check prints as the hint.
- `SendCounter` counts the bytes this rank sends point-to-point, however they are sent (dist.send, dist.isend,
  P2POp with batch_isend_irecv, with or without a group): it wraps ProcessGroup.send, which every one of those
  ends in, and still calls it. It also notes any collective called meanwhile, so a test can tell a ring built
  from isend/irecv from one that called dist.all_reduce.
- `not_implemented(fn, *args)` calls fn once in this process, where no process group exists: a stub raises
  NotImplementedError at once, while real code fails on its first torch.distributed call. Tests use it to
  report "not implemented yet" without starting ranks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroup

from zeroedu.i18n import tr
from zeroedu.launch import CollectiveMismatchError, LaunchError, RankError, RankHangError, launch

__all__ = ["SendCounter", "launch_timeout", "not_implemented", "ring_hang_hint", "run_on_ranks"]

_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
                "allgather_into_tensor_coalesced", "all_gather_single", "reduce_scatter", "_reduce_scatter_base",
                "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather",
                "scatter", "alltoall", "alltoall_base", "all_to_all_single")


def launch_timeout(default: float = 60.0) -> float:
    """Seconds a test's launch may take. The grader sets ZEROEDU_TEST_TIMEOUT below its own cell timeout, so a
    deadlock ends as a clear RankHangError from launch() rather than as a killed cell."""
    try:
        return max(1.0, float(os.environ.get("ZEROEDU_TEST_TIMEOUT", default)))
    except ValueError:
        return default


class SendCounter:
    """`with SendCounter() as c: ...` then c.sent (bytes), c.sends (messages), c.collectives (names called)."""

    def __init__(self) -> None:
        self.sent = 0
        self.sends = 0
        self.collectives: list[str] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> SendCounter:
        # pybind11 keeps methods in the class __dict__ as descriptors; getattr gives the plain function, which
        # takes the group as its first argument. Restore the descriptors themselves on exit.
        for name in ("send", *_COLLECTIVES):
            if name in ProcessGroup.__dict__:
                self._saved[name] = ProcessGroup.__dict__[name]
                setattr(ProcessGroup, name, self._wrap(name, getattr(ProcessGroup, name)))
        return self

    def _wrap(self, name: str, original: Callable) -> Callable:
        if name == "send":
            def send(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
                self.sent += sum(t.numel() * t.element_size() for t in tensors)
                self.sends += 1
                return original(group, tensors, *args, **kwargs)
            return send

        def collective(group: Any, *args: Any, **kwargs: Any) -> Any:
            self.collectives.append(name)
            return original(group, *args, **kwargs)
        return collective

    def __exit__(self, *exc: Any) -> None:
        for name, descriptor in self._saved.items():
            setattr(ProcessGroup, name, descriptor)
        self._saved.clear()


def not_implemented(fn: Callable, *args: Any, **kwargs: Any) -> str | None:
    """The stub's message if fn(*args) raises NotImplementedError here (no process group), else None."""
    try:
        fn(*args, **kwargs)
    except NotImplementedError as e:
        return str(e) or tr("it raises NotImplementedError", "它抛出了 NotImplementedError")
    except Exception:  # real code: it got as far as needing a process group (or failed otherwise) -> run it
        return None
    return None


# A traceback frame ('File "x", line 3, in f') or a faulthandler frame ('File "x", line 3 in f'), and the
# source line under it when there is one.
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)[^\n]*(?:\n[ \t]+(?!File ")(\S[^\n]*))?')


def _learner_line(text: str, innermost_first: bool = False) -> str:
    """' in fn, line 7 of its cell: code' for the innermost frame outside libraries and zeroedu."""
    own = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # all of zeroedu
    frames = [m for m in _FRAME.finditer(text)
              if "site-packages" not in m.group(1) and not m.group(1).startswith(own)
              and "/lib/python3" not in m.group(1)]
    if not frames:
        return ""
    m = frames[0] if innermost_first else frames[-1]
    code = tr(f": {m.group(4).strip()}", f"：{m.group(4).strip()}") if m.group(4) else ""
    return tr(f" in {m.group(3)}, line {m.group(2)} of its cell{code}",
              f"，位于 {m.group(3)}，所在单元格第 {m.group(2)} 行{code}")


def ring_hang_hint() -> str:
    """What to check when a ring hangs, in the course's language (run_on_ranks's hang_hint for exercise 2)."""
    return tr("In a ring every dist.isend needs the matching dist.irecv on the neighbour, with the same size; "
              "wait() on both before reusing buffers; and a blocking dist.recv before dist.send on every rank "
              "waits forever.",
              "在 ring 里，每个 dist.isend 都要在相邻 rank 上有大小相同、与之配对的 dist.irecv；"
              "复用缓冲区之前两边都要 wait()；"
              "而如果每个 rank 都先阻塞地 dist.recv 再 dist.send，就会永远等下去。")


def run_on_ranks(job: Callable, world_size: int, args: tuple = (), what: str | None = None,
                 timeout: float | None = None, hang_hint: str = "") -> list:
    """launch(job, world_size, args) -> per-rank results; failures -> AssertionError in plain words: the whole
    exception message (gloo's included) and the learner's line; for a hang, the rank that is not in the
    collective the others wait in, and where it is."""
    timeout = timeout or launch_timeout()
    what = what or tr("your code", "你的代码")
    try:
        # A wait in a collective is called a hang well before the whole run's limit: the launcher's hang check names
        # the rank that is not in the collective; its time limit (a limit, not a diagnosis) blames no rank.
        return launch(job, world_size=world_size, args=args, timeout=timeout, hang_timeout=0.5 * timeout)
    except RankError as e:
        head = re.sub(r"^rank (\d+) of (\d+) raised ",
                      tr(r"on rank \1 of \2, " + what + " raised ",
                         r"在 \2 个 rank 中的 rank \1 上，" + what + " 抛出了 "),
                      _whole(e))
        raise AssertionError(head + _learner_line(e.traceback)) from None
    except RankHangError as e:
        where = ""
        culprits = list(e.culprits)
        for rank in culprits or sorted(e.stacks):
            line = _learner_line(e.stacks.get(rank, ""), innermost_first=True)  # faulthandler: newest call first
            status = e.statuses.get(rank, "")
            if culprits:
                where = tr(f" Rank {rank} is not in the collective the other ranks wait in ({status})",
                           f" rank {rank} 没有进入其他 rank 正在等待的集合通信（{status}）")
                where += tr(f"; it is{line}.", f"{line}。") if line else tr(".", "。")
                break
            if line:
                where = tr(f" Rank {rank} was waiting{line}.", f" rank {rank} 在等待{line}。")
                break
        hint = f" {hang_hint}" if hang_hint else ""
        raise AssertionError(tr(f"{what} hung: a rank waited more than {0.5 * timeout:g} s in one collective."
                                f"{where}{hint}",
                                f"{what} 卡住了：有 rank 在同一个集合通信里等了超过 {0.5 * timeout:g} s。"
                                f"{where}{hint}")) from None
    except CollectiveMismatchError as e:
        raise AssertionError(tr(f"{what}: ranks called different collectives ({_whole(e)})",
                                f"{what}：各 rank 调用了不同的集合通信（{_whole(e)}）")) from None
    except LaunchError as e:
        raise AssertionError(tr(f"could not run {what} on {world_size} ranks: {_whole(e)}",
                                f"无法在 {world_size} 个 rank 上运行 {what}：{_whole(e)}")) from None


MAX_RANK_MESSAGE = 1800   # characters of a launcher's message kept (the grader cuts notes to --max-output too)


def _whole(e: BaseException) -> str:
    """The launcher's whole message on one line (gloo's text and every rank's status included), without the
    tracebacks it appends, cut to MAX_RANK_MESSAGE characters."""
    head = str(e).split("\n\nTraceback from rank", 1)[0]
    head = " ".join(line.strip() for line in head.splitlines() if line.strip())
    return head[:MAX_RANK_MESSAGE] + " [...]" if len(head) > MAX_RANK_MESSAGE else head
