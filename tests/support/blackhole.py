"""Network partitions on loopback, made with Debian's iptables: every packet of a port, or of one
connection, dropped (no RST, no FIN), the way a peer that lost its network looks from the other
side. A refused or reset socket is an error at once; a blackholed one is silence, which only the
project's own timeouts end (issue 24).

Each rule carries a comment naming this process, is deleted when its block ends however it ends,
and `remove_leftover_rules` (run by the suite's guard in tests/conftest.py) deletes any rule a
killed test process left behind and reports it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

#: Every rule of the suite carries this comment (plus the pid of the process that made it).
COMMENT_PREFIX = "pin-test-blackhole"
#: Which packets of the port are dropped: both ways (a partition), or only those the port's owner
#: sends (its answers: the peer's requests arrive, it never hears back) or receives.
Direction = Literal["both", "from_port", "to_port"]


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("iptables")
    if binary is None:
        raise RuntimeError("iptables is not installed (bin/test installs Debian's iptables)")
    return subprocess.run([binary, "-w", "5", *args], capture_output=True, text=True, check=False)


def _rule_specs(port: int, direction: Direction) -> list[list[str]]:
    comment = ["-m", "comment", "--comment", f"{COMMENT_PREFIX}-{os.getpid()}"]
    matches = {"to_port": ["--dport"], "from_port": ["--sport"], "both": ["--dport", "--sport"]}
    return [
        ["INPUT", "-p", "tcp", match, str(port), *comment, "-j", "DROP"]
        for match in matches[direction]
    ]


@contextmanager
def blackhole(ports: int | Sequence[int], direction: Direction = "both") -> Iterator[None]:
    """Drop the TCP packets of `ports` on this machine's loopback while the block runs.

    A port is a server's (every connection to it is cut, new ones hang in SYN) or a client's
    (`client_port` of pg_stat_activity: that one connection is cut, all others flow). Loopback
    packets pass INPUT once, so a rule there on the source and one on the destination port
    drop both directions."""
    specs = [
        spec
        for port in ([ports] if isinstance(ports, int) else ports)
        for spec in _rule_specs(port, direction)
    ]
    inserted: list[list[str]] = []
    try:
        for spec in specs:
            result = _iptables("-I", *spec)
            if result.returncode != 0:
                raise RuntimeError(f"iptables -I {' '.join(spec)}: {result.stderr.strip()}")
            inserted.append(spec)
        yield
    finally:
        failures = []
        for spec in inserted:
            result = _iptables("-D", *spec)
            if result.returncode != 0:
                failures.append(f"iptables -D {' '.join(spec)}: {result.stderr.strip()}")
        if failures:
            raise RuntimeError("; ".join(failures))


def remove_leftover_rules() -> list[str]:
    """Delete the rules of the suite still in place that no live block holds: this process's
    (a test's block has ended when this is called) and those of a process that is gone (killed
    inside its block); returns them as `iptables -S` printed them. Another live test session's
    rules are its own. No iptables: nothing can be left."""
    if shutil.which("iptables") is None:
        return []
    left = []
    for line in _iptables("-S", "INPUT").stdout.splitlines():
        owner = re.search(rf"{COMMENT_PREFIX}-(\d+)", line)
        if owner and line.startswith("-A ") and not _alive_elsewhere(int(owner.group(1))):
            left.append(line)
            # `-A INPUT …` as printed is the rule's spec, and deleting takes the same words
            # after -D (iptables -S quotes a comment with spaces; ours have none).
            _iptables("-D", *line[3:].split())
    return left


def _alive_elsewhere(pid: int) -> bool:
    return pid != os.getpid() and os.path.exists(f"/proc/{pid}")
