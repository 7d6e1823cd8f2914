"""What crossed between a sandbox's processes, counted by the operating system: the grader's cross-check of the
bytes a notebook's ranks say they sent.

Ranks measure their own traffic (the engine's ledger, SendCounter), in processes that also run the learner's code,
which can rebind the ledger or torch.distributed and so report bytes that were never sent (data passed through
files instead, say). What the learner cannot rebind is the kernel of the operating system: every byte gloo moves
between ranks goes over TCP on the loopback device of the sandbox's own network namespace (bwrap --unshare-net),
and Linux counts it there. The ranks meet through a FileStore and send their results back through pipes, so the
only TCP traffic of an honest run is gloo's. The grader reads those counters from outside the sandbox
(/proc/<pid>/net of a process in it) before and after each request it sends the kernel.

What this proves: bytes the ranks say they sent that exceed what crossed the wire were not sent. What it cannot
prove: that the bytes that did cross were the collectives the ledger names (the wire carries bytes, not names: a
reduce-scatter and an all-gather move what one all-reduce moves), or the number of calls; and a submission that
sends padding over a socket of its own can make the wire look busier than it was.
"""

from __future__ import annotations

import os
from pathlib import Path

from zeroedu.i18n import tr

# On loopback each IPv4 packet of TCP carries IPv4's 20-byte header and TCP's 20, plus the 12-byte timestamps option
# that Linux sends by default; IPv6's header is 20 bytes longer. A SYN or SYN-ACK carries 8 more bytes of options
# (MSS, SACK permitted, window scale), a reset no timestamps. Packets are counted by IP (OutRequests), not by TCP:
# TCP counts a large send as several segments where loopback passes one packet with one header.
HEADER_V4 = 52
HEADER_V6 = 72
HANDSHAKE_OPTIONS = 8
RESET_SAVES = 12


def _table(text: str, prefix: str) -> dict[str, int]:
    """A /proc/net/{snmp,netstat} table ('Tcp: Name ...' then 'Tcp: 1 2 ...') as {name: value}."""
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith(prefix + ":")]
    if len(rows) < 2:
        return {}
    return {k: int(v) for k, v in zip(rows[0], rows[1], strict=False) if v.lstrip("-").isdigit()}


def tcp_payload(pid: int) -> int | None:
    """Bytes of TCP payload sent in the network namespace of process `pid` since the namespace was made (IP's
    octets less the headers of its packets, see HEADER_V4), or None if its counters cannot be read. Exact for TCP
    between processes on loopback; packets of other protocols only lower it."""
    try:
        snmp = Path(f"/proc/{pid}/net/snmp").read_text()
        netstat = Path(f"/proc/{pid}/net/netstat").read_text()
        snmp6 = Path(f"/proc/{pid}/net/snmp6").read_text() if Path(f"/proc/{pid}/net/snmp6").exists() else ""
    except OSError:
        return None
    tcp, ip, ipext = _table(snmp, "Tcp"), _table(snmp, "Ip"), _table(netstat, "IpExt")
    if "OutRequests" not in ip or "OutOctets" not in ipext:
        return None
    v6 = dict(line.split()[:2] for line in snmp6.splitlines() if line.startswith("Ip6Out"))
    octets = ipext["OutOctets"] + int(v6.get("Ip6OutOctets", 0))
    headers = (HEADER_V4 * ip["OutRequests"] + HEADER_V6 * int(v6.get("Ip6OutRequests", 0))
               + HANDSHAKE_OPTIONS * (tcp.get("ActiveOpens", 0) + tcp.get("PassiveOpens", 0))
               - RESET_SAVES * tcp.get("OutRsts", 0))
    return max(0, octets - headers)


def namespace_pid(root: int) -> int | None:
    """A process at or below `root` (bwrap, as the grader started it) in a network namespace other than the
    grader's: the sandbox's. None if there is none (no sandbox, or it is gone)."""
    try:
        own = os.readlink("/proc/self/ns/net")
    except OSError:
        return None
    todo, looked = [root], 0
    while todo and looked < 64:   # bwrap, its child in the new namespaces: found within a few steps
        pid = todo.pop(0)
        looked += 1
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != own:
                return pid
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return None


class Meter:
    """The TCP payload sent inside one sandbox: `read()` is the running total, None where it cannot be counted.
    The sandbox's first process is looked up once (its namespace lives as long as the kernel)."""

    def __init__(self, root_pid: int | None) -> None:
        self.root_pid = root_pid
        self.pid: int | None = None

    def read(self) -> int | None:
        if self.root_pid is None:
            return None
        if self.pid is None or not os.path.exists(f"/proc/{self.pid}"):
            self.pid = namespace_pid(self.root_pid)
        return None if self.pid is None else tcp_payload(self.pid)


def claim_problem(claimed: int, crossed: int | None, what: str, source: str) -> str | None:
    """The verdict's reason when the ranks claim more bytes than crossed between them, else None (also when the
    wire could not be counted: not sandboxed, or a learner's own notebook)."""
    if crossed is None or claimed <= crossed:
        return None
    return tr(f"{what}: the ranks report {claimed} bytes sent ({source}), but only {crossed} bytes of data crossed "
              "between the processes of this notebook, counted by the operating system outside your code's reach. "
              "Bytes that were never sent were reported: something in your code rebinds what measures them (the "
              "ledger, torch.distributed, the send counter) or moves data another way. This test scores 0.",
              f"{what}：各 rank 报告发送了 {claimed} 字节（{source}），但这个 notebook 的进程之间实际只传了 "
              f"{crossed} 字节数据，这是由操作系统在你的代码够不到的地方统计的。报告里有从未发送过的字节："
              "你的代码改绑了统计字节的东西（通信账本 ledger、torch.distributed、发送计数器），"
              "或者用别的途径传了数据。这个测试记 0 分。")
