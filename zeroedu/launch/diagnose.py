"""What the parent makes of the ranks: collective mismatches, hangs and dead ranks, in messages that name them.

The parent (zeroedu.launch) reads every rank's status slot (zeroedu.launch_status) into a `View`. From the views
this module tells a rank that is merely behind from one in a different collective (`find_mismatch`), names the
ranks that keep a hung one waiting (`holdouts`), and writes the text of every error launch() raises: each rank's
status, its Python stack (faulthandler, asked for with SIGUSR1), the tail of its stderr, and why a process died
(a signal, the kernel's out-of-memory killer).
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import sys
import time
from collections import Counter

from zeroedu.launch.status import RAW

MISMATCH_SECONDS = 1.0      # two ranks stuck in different collectives this long: a mismatch, not a lag
STACK_WAIT = 0.5            # seconds to wait for faulthandler stack dumps
_TAIL_LINES = 30
_P2P_OPS = {"send", "recv", "isend", "irecv"}  # point-to-point: ranks legitimately run different ops


# -- what the parent reads from the slots --------------------------------------------------------------------

class View:
    """One rank as the parent sees it: its slot and whether its process is alive or returned."""

    def __init__(self, rank: int, state: dict | None, returned: bool, exitcode: int | None,
                 pid: int | None = None) -> None:
        self.rank = rank
        self.state = state
        self.returned = returned
        self.exitcode = exitcode
        self.stopped = exitcode is None and pid is not None and _is_stopped(pid)
        self.waiting: tuple[str, int, str] | None = None
        if state is not None and state["s"].startswith("waiting|"):
            _, key, seq, sig = state["s"].split("|", 3)
            self.waiting = (key, int(seq), sig)

    def waited(self, now: float) -> float:
        return now - self.state["t"] if self.waiting else 0.0

    def history(self, key: str) -> list[list]:
        return (self.state or {}).get("d", {}).get(key, [])

    def knows_all_groups(self) -> bool:
        return bool((self.state or {}).get("full", True))


def _is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, Ctrl-Z, a debugger): state T or t in /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


# torch.distributed's names for what zeroedu's comm layer calls all_gather and reduce_scatter
_RAW_AS = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


def _same(sig_a: str, sig_b: str) -> bool:
    """Same collective: op, dtype and numel agree (the phase is only a label). A raw torch.distributed call
    against one of zeroedu's comm layer is compared by op alone: the two describe sizes differently."""
    if sig_a.startswith(RAW + ".") != sig_b.startswith(RAW + "."):
        return _RAW_AS.get(_op(sig_a), _op(sig_a)) == _RAW_AS.get(_op(sig_b), _op(sig_b))
    return sig_a.rsplit(" (", 1)[0] == sig_b.rsplit(" (", 1)[0]


def _op(sig: str) -> str:
    return sig.split(" ", 1)[0].rsplit(".", 1)[-1]


def _members(key: str, views: list[View]) -> list[int]:
    """Global ranks of a group: from its key "0,1,2,3" (point-to-point: "0,1 (p2p)"),
    else every rank that ever used that key."""
    try:
        return [int(r) for r in key.split(" ", 1)[0].split(",")]
    except ValueError:
        return [v.rank for v in views if v.history(key) or (v.waiting and v.waiting[0] == key)]


def describe_rank(v: View, now: float) -> str:
    if v.stopped:   # what its slot says it was doing is true, but it is not doing it: it runs nothing at all
        return ("stopped (SIGSTOP, Ctrl-Z or a debugger: process state T), so it runs nothing, not even its "
                "collectives, until it gets SIGCONT; when it stopped it was " + _describe_slot(v, now))
    return _describe_slot(v, now)


def _describe_slot(v: View, now: float) -> str:
    if v.state is None:
        text = "not started (its process has not reached zeroedu's rank entry point)"
    elif v.waiting:
        key, seq, sig = v.waiting
        text = f"waiting in {sig}, collective #{seq} of group {key}, for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "starting":
        text = f"starting: loading fn and its arguments for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "joining":
        text = f"joining the process group (it waits for every rank) for {now - v.state['t']:.1f} s"
    elif v.state["s"] == "returned" or v.returned:
        text = "returned from fn"
    else:
        note = v.state["s"].removeprefix("running").removeprefix(": ")
        text = f"running user code, not in a collective, for {now - v.state['t']:.1f} s" + (
            f" ({note})" if note else "")
    done = [(h[2], key, h[0], h[1]) for key, hist in (v.state or {}).get("d", {}).items() for h in hist[-1:]]
    if done:
        _, key, seq, sig = max(done)
        text += f"; last collective done: {sig}, #{seq} of group {key}"
    elif v.state is not None:
        text += "; no collective done yet"
    if v.exitcode is not None and not v.returned:
        text += f"; process exited ({_exit_text(v.exitcode)})"
    return text


def find_mismatch(views: list[View], now: float) -> str | None:
    """Return why ranks can never meet, or None. Only definite cases: the seq counters let us tell a rank that
    is merely behind (it will finish the collective the others already did) from one in a different one."""
    waiters = [v for v in views if v.waiting and v.waited(now) >= MISMATCH_SECONDS]
    for a in waiters:
        key, seq, sig = a.waiting
        if _op(sig) in _P2P_OPS:
            continue
        for b in waiters:
            if b.rank == a.rank or b.waiting[0] != key or _op(b.waiting[2]) in _P2P_OPS:
                continue
            b_seq, b_sig = b.waiting[1:]
            if b_seq == seq and not _same(sig, b_sig) and a.rank < b.rank:
                return f"ranks {a.rank} and {b.rank} are both at collective #{seq} of group {key}, but rank " \
                       f"{a.rank} is in {sig} and rank {b.rank} in {b_sig}"
            if b_seq > seq:  # b is ahead: what did b run as collective #seq?
                ran = [h[1] for h in b.history(key) if h[0] == seq]
                if ran and not _same(ran[0], sig):
                    return f"rank {a.rank} waits in {sig} as collective #{seq} of group {key}, but rank " \
                           f"{b.rank} ran {ran[0]} as #{seq} and has moved on to {b_sig} (#{b_seq})"
        for m in _members(key, views):
            left = views[m] if 0 <= m < len(views) else None
            if left is None or m == a.rank or not (left.returned or left.state and left.state["s"] == "returned"):
                continue
            history = left.history(key)
            last = history[-1][0] if history else 0
            ran = [h[1] for h in history if h[0] == seq]
            if ran and not _same(ran[0], sig):
                return f"rank {a.rank} waits in {sig} as collective #{seq} of group {key}, but rank {m} ran " \
                       f"{ran[0]} as #{seq} and then returned from fn"
            if last < seq and (history or left.knows_all_groups()):
                done = f"its last collective on that group was #{last} {history[-1][1]}" if history else \
                    "it never ran a collective on that group"
                return f"rank {m} returned from fn while rank {a.rank} waits in {sig}, collective #{seq} of " \
                       f"group {key}, which contains rank {m} ({done})"
    return None


def holdouts(views: list[View]) -> dict[int, str]:
    """Ranks that keep a waiting rank waiting: members of its group that are not in the same collective."""
    culprits: dict[int, str] = {}
    for a in views:
        if not a.waiting:
            continue
        key, seq, sig = a.waiting
        for m in _members(key, views):
            if m == a.rank or not 0 <= m < len(views) or m in culprits:
                continue
            b = views[m]
            if b.waiting and b.waiting[0] == key and b.waiting[1] == seq and _same(b.waiting[2], sig):
                continue
            if b.waiting:
                why = f"it waits in {b.waiting[2]} (#{b.waiting[1]} of group {b.waiting[0]}) instead"
            elif b.state is None or b.state["s"] in ("starting", "joining"):
                why = "it never joined the process group"
            elif b.returned or b.state["s"] == "returned":
                why = "it returned from fn"
            else:
                why = "it is running user code, not in any collective"
            culprits[m] = f"rank {a.rank} waits for it in {sig} (#{seq} of group {key}); {why}"
    return culprits


# -- text helpers --------------------------------------------------------------------------------------------

_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+)(,?) in ')


def _with_source(text: str) -> str:
    """Add source lines to traceback/faulthandler frames from the parent's linecache. faulthandler prints no
    source at all, and a rank has no source for functions defined in notebook cells, but the kernel does."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        m = _FRAME.match(line)
        if not m:
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m.group(4) and nxt.startswith(m.group(1) + "  ") and not _FRAME.match(nxt):
            continue  # a traceback frame that already shows its source
        src = linecache.getline(m.group(2), int(m.group(3))).strip()
        if src:
            out.append(f"{m.group(1)}    {src}")
    return "\n".join(out)


def _trim_stack(text: str) -> str:
    """A faulthandler dump without launch's own machinery: drop the thread that watches the parent, and the
    multiprocessing bootstrap frames below rank_main (faulthandler prints the most recent call first)."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if "in _watch_parent" in block or "in _wait_for_stop_signal" in block:
            continue
        lines = block.splitlines()
        cut = next((i for i, line in enumerate(lines) if line.endswith(" in rank_main")), None)
        blocks.append("\n".join(lines if cut is None else lines[:cut + 1]))
    return "\n\n".join(blocks)


# How a C++ exception that aborts a rank (gloo's "Is there a distributed collective mismatch in your code?") starts
# its message: printed before the stack dump that fills the tail.
_ABORT_LINES = ("terminate called after throwing", "  what():", "Fatal Python error")


def _tail(path: str, n: int = _TAIL_LINES) -> str:
    """The last n lines of a rank's stderr, after the lines that say why the process aborted, if any."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    cause = [line for line in lines[:-n] if line.startswith(_ABORT_LINES)]
    return "\n".join(cause + ["..."] * bool(cause) + lines[-n:])


def _exit_text(code: int, pid: int | None = None) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {"SIGKILL": " (the kernel's out-of-memory killer, a user or a job scheduler)",
            "SIGTERM": " (a user, a job scheduler or a container runtime asked it to stop)",
            "SIGSEGV": " -- a crash in native code", "SIGBUS": " -- a crash in native code"}.get(name, "")
    if name == "SIGKILL" and pid is not None:
        line = _kernel_kill_line(_kernel_log(), pid)
        hint += (f". The kernel log says: {line!r} -- out of memory: try a smaller model or world_size" if line else
                 ". The kernel log has no out-of-memory entry for it (or cannot be read here: `dmesg` shows it)")
    return f"killed by {name}{hint}"


def _kernel_log() -> list[str]:
    """The kernel's log lines, newest last, where this user may read them (/dev/kmsg); else []."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    lines = []
    try:
        while True:
            try:
                record = os.read(fd, 8192)   # one record per read
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == 32:            # EPIPE: overwritten while we read; the next read goes on
                    continue
                break
            if not record:
                break
            lines.append(record.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0])
    finally:
        os.close(fd)
    return lines


def _kernel_kill_line(lines: list[str], pid: int) -> str | None:
    """The out-of-memory killer's line about `pid` (mm/oom_kill.c: "Out of memory: Killed process PID (comm)
    ..." or "Memory cgroup out of memory: Killed process PID ..."), the newest if several."""
    pattern = re.compile(rf"Killed process {pid}\b")
    found = [line.strip() for line in lines if pattern.search(line)]
    return found[-1] if found else None


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


# -- the messages of launch()'s errors -----------------------------------------------------------------------

def _stderr_tail(run_dir: str, rank: int) -> str:
    tail = _tail(os.path.join(run_dir, f"rank{rank}.stderr"))
    return f"\n\nLast lines of rank {rank}'s stderr:\n{_indent(tail)}" if tail.strip() else ""


def raised_message(run_dir: str, world_size: int, rank: int, exc_type: str, exc_msg: str,
                    tb: str) -> tuple[str, str]:
    """A rank raised: the message, and the rank's traceback with source lines added."""
    tb = _with_source(tb)
    msg = (f"rank {rank} of {world_size} raised {exc_type}: {exc_msg}\n\n"
           f"Traceback from rank {rank}:\n{tb.rstrip()}{_stderr_tail(run_dir, rank)}\n\n"
           f"The other ranks were stopped.")
    return msg, tb


def died_message(run_dir: str, world_size: int, rank: int, code: int, pid: int | None, state: dict | None) -> str:
    """A rank's process ended without raising (exit code `code`); `state` is its last status slot."""
    hint = ""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if state is None and main_file and os.path.isfile(main_file):
        hint = (f"\nIt died before reaching zeroedu's rank entry point, while multiprocessing ran {main_file} "
                "in it: every rank runs the parent's script first. Put the script's launch() call under "
                "`if __name__ == \"__main__\":`.")
    elif state is None:
        hint = "\nIt died before reaching zeroedu's rank entry point (see its stderr below)."
    return (f"rank {rank} of {world_size} died without raising an exception: "
            f"{_exit_text(code, pid)}."
            f"{hint}{_stderr_tail(run_dir, rank)}\n\nThe other ranks were stopped.")


def not_joined_message(run_dir: str, views: list[View], not_joined: list[int], now: float, t0: float) -> str:
    lines = "\n".join(f"  rank {v.rank}: {describe_rank(v, now)}" for v in views)
    tails = "".join(_stderr_tail(run_dir, r) for r in not_joined)
    return (f"rank(s) {', '.join(map(str, not_joined))} did not start and join the process group within "
            f"{now - t0:.1f} s:\n{lines}{tails}\n\nThe machine may be overloaded (too many ranks for its "
            f"cores or memory): try a smaller world_size.")


def mismatch_message(why: str, statuses: dict[int, str]) -> str:
    lines = "\n".join(f"  rank {r}: {s}" for r, s in statuses.items())
    return (f"collective mismatch: {why}. This would deadlock.\nStatus of every rank:\n{lines}\n\n"
            "Every rank of a group must call the same collectives in the same order with the same dtype and "
            "size. Look for a collective under `if rank == ...`, or a loop that runs a different number of "
            "times on different ranks.")


def stuck_message(v: View, now: float, hang_timeout: float) -> str:
    """What a rank stuck in a collective longer than hang_timeout waited in, and for how long."""
    return (f"rank {v.rank} waited in {v.waiting[2]} (#{v.waiting[1]} of group {v.waiting[0]}) for "
            f"{v.waited(now):.1f} s > hang_timeout={hang_timeout} s")


def where_text(statuses: dict[int, str], stacks: dict[int, str]) -> str:
    """Every rank's status and Python stack, as the text that errors show."""
    lines = "\n".join(f"  rank {r}: {s}" for r, s in statuses.items())
    dumps = "\n".join(f"--- rank {r} ---\n{_indent(s or '(no stack: the process did not answer)')}"
                      for r, s in stacks.items())
    return (f"Status of every rank:\n{lines}\n\nPython stack of every rank (faulthandler, "
            f"most recent call first):\n{dumps}")


def timeout_message(fn_name: str, now: float, t0: float, timeout: float, last: float, where: str) -> str:
    """launch() ran past `timeout`; `last` is when any rank's status last changed."""
    return (f"launch({fn_name}) stopped at its time limit: it ran {now - t0:.1f} s > timeout="
            f"{timeout} s, the limit this call passed, so the ranks were stopped. That is a limit, not a "
            f"diagnosis: the last change of any rank's status was {now - last:.1f} s ago (hangs in a collective "
            f"are what hang_timeout catches).\n{where}\n\nPass a larger timeout, or timeout=None (the default) "
            "for no limit.")


def hang_message(what: str, views: list[View], culprits: dict[int, str], where: str) -> str:
    if culprits:
        blame = "Likely culprit: " + "; ".join(f"rank {r} ({why})" for r, why in sorted(culprits.items()))
    elif any(v.waiting for v in views):
        blame = "Every rank waits in the same collective: look at the stacks below."
    else:
        blame = "No rank is in a collective: fn is slow or stuck in user code on every rank."
    fix = "If a rank legitimately computes that long between collectives, raise hang_timeout (None: off)."
    return f"ranks hung: {what}.\n{blame}\n\n{where}\n\n{fix}"


def collect_stacks(run_dir: str, procs: list, world_size: int) -> dict[int, str]:
    """Ask every live rank for its Python stack (faulthandler prints it on SIGUSR1) and read the files."""
    paths = {r: os.path.join(run_dir, f"rank{r}.stack") for r in range(world_size)}
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    stopped = [r for r in alive if _is_stopped(procs[r].pid)]
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    for r in stopped:   # a stopped rank handles SIGUSR1 only once continued: let it run for the dump, then stop it
        try:
            os.kill(procs[r].pid, signal.SIGCONT)
        except OSError:
            pass
    deadline = time.monotonic() + STACK_WAIT
    while time.monotonic() < deadline and not all(os.path.getsize(paths[r]) if os.path.exists(paths[r])
                                                  else 0 for r in alive):
        time.sleep(0.02)
    time.sleep(0.05)  # let the last dump finish writing
    for r in stopped:
        try:
            os.kill(procs[r].pid, signal.SIGSTOP)   # as it was: the report shows it stopped
        except OSError:
            pass
    return {r: _with_source(_trim_stack(_tail(paths[r], 400))) for r in range(world_size)}


def sequence_note(views: list[View], failure: str) -> str:
    """When a rank died or raised: every rank's newest collectives and call line (zeroedu.comm.agreement's record in
    its slot), naming the rank(s) whose sequence differs from the others'. gloo kills whichever rank first sees
    the mismatched message, which is as often the rank that did nothing wrong."""
    recs = {v.rank: v.state["a"] for v in views if v.state and isinstance(v.state.get("a"), dict)}
    if len(recs) < 2 or "DriftError: " in failure:   # the agreement check's own error already compares the ranks
        return ""
    odd, why = _odd_ranks(recs)
    if not odd and not why and "gloo" not in failure and "mismatch" not in failure:
        return ""
    lines = []
    for r, a in sorted(recs.items()):
        newest = "; ".join(f"#{i} {sig}" for i, sig in a.get("r", [])) or "none"
        lines.append(f"  rank {r}{' (differs)' if r in odd else ''}: after {a['c']} optimizer steps, {a['b']} "
                     f"backward() (the last engine call at {a.get('w') or 'an unknown line'}); its newest "
                     f"collectives since that step: {newest}")
    head = (f"The ranks' sequences of collectives differ: rank(s) {', '.join(map(str, odd))} {why}." if odd else
            f"The ranks' sequences of collectives differ{why}; each rank's newest collectives:")
    from zeroedu.comm.agreement import GATHER_OF, ROUTING_HINT

    tail = "\n" + ROUTING_HINT if GATHER_OF in why else ""
    return "\n\n" + head + "\n" + "\n".join(lines) + tail


def _odd_ranks(recs: dict[int, dict]) -> tuple[list[int], str]:
    """The ranks whose record differs from the rest, and why; ([], "") when none can be named."""
    from zeroedu.comm.agreement import UNFINISHED

    broken = [r for r, a in recs.items() if a.get("u") is not None]
    if broken and len(broken) < len(recs):
        at = min(recs[r]["u"] for r in broken)
        return broken, f"had an engine.backward() raise part-way at optimizer step {at}. " + UNFINISHED
    over = [r for r, a in recs.items() if a["b"] > a.get("acc", 1)]
    if over and len(over) < len(recs):
        return over, ("called engine.backward() more often since its last engine.step() than "
                      "gradient_accumulation_steps allows: it skipped engine.step()")
    # The first collective (counted from the last step both reached) where the newest records disagree.
    by_rank = {r: {(a["c"], i): sig for i, sig in a.get("r", [])} for r, a in recs.items()}
    common = set.intersection(*(set(d) for d in by_rank.values()))
    for at in sorted(common):
        shown = {r: d[at] for r, d in by_rank.items()}
        sigs = {r: sig.split(" @ ", 1)[0] for r, sig in shown.items()}   # " @ file:line": the call, not compared
        votes = Counter(sigs.values()).most_common()
        if len(votes) > 1 and votes[0][1] > votes[1][1]:
            odd = [r for r, sig in sigs.items() if sig != votes[0][0]]
            return odd, (f"ran {', '.join(sorted({shown[r] for r in odd}))} as collective #{at[1]} after "
                         f"{at[0]} optimizer steps, where the others ran {votes[0][0]}")
        if len(votes) > 1:   # no majority (two ranks): say where they part, and what each called from where
            return [], (f" from collective #{at[1]} after {at[0]} optimizer steps on ("
                        + "; ".join(f"rank {r} called {sig.replace(' @ ', ' from ')}" for r, sig in
                                    sorted(shown.items())) + ")")
    return [], ""
