"""Network partitions on loopback, made with Debian's iptables: every packet of a port, or of one
connection, dropped (no RST, no FIN), the way a peer that lost its network looks from the other
side. A refused or reset socket is an error at once; a blackholed one is silence, which only the
project's own timeouts end.

`isolate` cuts processes of one machine off from each other while every other process still
reaches all of them: a broker from the other brokers of a loopback cluster (a minority partition,
tests/integration/test_kafka_partitions.py). All of them listen on 127.0.0.1, so a port rule cuts
the clients too; the rules of `isolate` match the sending socket's cgroup instead (below).

Each rule carries a comment naming this process, is deleted when its block ends however it ends,
and `remove_leftover_rules` (run by the suite's guard in tests/conftest.py after a test that
entered a block, see `blocks_entered`, and once at the end of the session) deletes any rule (and
`isolate`'s cgroups) a killed test process left behind and reports it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

#: Every rule of the suite carries this comment (plus the pid of the process that made it).
COMMENT_PREFIX = "pin-test-blackhole"
#: Which packets of the port are dropped: both ways (a partition), or only those the port's owner
#: sends (its answers: the peer's requests arrive, it never hears back) or receives.
Direction = Literal["both", "from_port", "to_port"]
#: Blocks of `blackhole` and `isolate` entered by this process so far.
_blocks_entered = 0


def blocks_entered() -> int:
    """How many `blackhole` and `isolate` blocks this process has entered: the suite's guard
    looks for leftover rules after a test only when this changed during it (two `iptables -S`
    runs after every test were a cost of the whole suite for two modules' sake)."""
    return _blocks_entered


def _entering() -> None:
    global _blocks_entered
    _blocks_entered += 1


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
    _entering()
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
        failures = _delete(inserted)
        if failures:
            raise RuntimeError(failures)


def _delete(specs: Sequence[Sequence[str]]) -> str:
    """Delete every rule of `specs`, each tried whatever happened to the others; what failed."""
    failures = []
    for spec in specs:
        result = _iptables("-D", *spec)
        if result.returncode != 0:
            failures.append(f"iptables -D {' '.join(spec)}: {result.stderr.strip()}")
    return "; ".join(failures)


def remove_leftover_rules() -> list[str]:
    """Delete the rules of the suite still in place that no live block holds: this process's
    (a test's block has ended when this is called) and those of a process that is gone (killed
    inside its block); returns them as `iptables -S` printed them. `isolate`'s rules are in
    OUTPUT, and its cgroups are removed the same way (their processes moved back to the root
    cgroup first). Another live test session's rules are its own. No iptables: nothing can be
    left."""
    if shutil.which("iptables") is None:
        return []
    left = []
    for chain in ("INPUT", "OUTPUT"):
        for line in _iptables("-S", chain).stdout.splitlines():
            owner = re.search(rf"{COMMENT_PREFIX}-(\d+)", line)
            if owner and line.startswith("-A ") and not _alive_elsewhere(int(owner.group(1))):
                left.append(line)
                # `-A INPUT …` as printed is the rule's spec, and deleting takes the same words
                # after -D (iptables -S quotes a comment with other than letters, digits, `-`
                # and `_`; ours have none, and shlex would undo the quotes).
                _iptables("-D", *shlex.split(line[3:]))
    root = _cgroup2_root()
    if root is not None:
        for group in sorted(root.glob(f"{COMMENT_PREFIX}-*")):
            owner = re.match(rf"{COMMENT_PREFIX}-(\d+)-", group.name)
            if owner and group.is_dir() and not _alive_elsewhere(int(owner.group(1))):
                moved = _empty_cgroup(group, root)
                left.append(f"cgroup {group} (processes {moved} moved to the root cgroup)")
    return left


def _alive_elsewhere(pid: int) -> bool:
    return pid != os.getpid() and os.path.exists(f"/proc/{pid}")


# --- isolate: processes of one machine cut off from each other -------------------------------


@dataclass(frozen=True)
class Peer:
    """A process of the partitioned system: its pid (a JVM's threads follow it) and the TCP
    ports it listens on (a Kafka node: its broker and its controller port)."""

    name: str
    pid: int
    ports: tuple[int, ...]


@dataclass
class Isolation:
    """What an `isolate` block put in place: the connections that were open between the two
    sides when it began (cut by their port pair), and the packets its rules dropped."""

    inside: tuple[Peer, ...]
    outside: tuple[Peer, ...]
    #: Each side's cgroup (cgroup2), by "inside" and "outside".
    groups: dict[str, Path]
    #: (port, port) of each connection between the sides open at the start, as ss listed it.
    cut: set[tuple[int, int]] = field(default_factory=set)
    _tags: list[str] = field(default_factory=list)

    def reaches(self, side: Literal["inside", "outside"], port: int, timeout: float = 2.0) -> bool:
        """Whether a new TCP connection from `side` to `port` on 127.0.0.1 is accepted: a probe
        process joins the side's cgroup before it opens its socket, as the side's own
        reconnecting clients do."""
        code = (
            "import socket, sys\n"
            "try:\n"
            "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), float(sys.argv[2]))\n"
            "except OSError:\n"
            "    sys.exit(1)\n"
        )
        probe = subprocess.run(
            ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.groups[side] / "cgroup.procs"),
             sys.executable, "-c", code, str(port), str(timeout)],
            capture_output=True, timeout=timeout + 30, check=False,
        )  # fmt: skip
        return probe.returncode == 0

    def dropped(self) -> dict[str, int]:
        """Packets dropped so far, per rule (its tag: `inside_to_9094`: sent from the inside
        cgroup to port 9094; `cut_41234_to_9092`: one direction of an open connection)."""
        counts: dict[str, int] = {}
        for line in _iptables("-v", "-S", "OUTPUT").stdout.splitlines():
            tag = re.search(rf"--comment {COMMENT_PREFIX}-{os.getpid()}-(\w+)", line)
            packets = re.search(r" -c (\d+) \d+", line)
            if tag and packets and tag.group(1) in self._tags:
                counts[tag.group(1)] = counts.get(tag.group(1), 0) + int(packets.group(1))
        return counts


def _cgroup2_root() -> Path | None:
    """Where the cgroup2 hierarchy is mounted (`/sys/fs/cgroup` on a pure v2 host,
    `/sys/fs/cgroup/unified` on a hybrid one like this machine), or None."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def _cgroup_of(pid: int, root: Path) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


def _move(pid: int, group: Path) -> None:
    """Move the whole process (every thread) into `group`; a process already gone is left."""
    with contextlib.suppress(ProcessLookupError):
        (group / "cgroup.procs").write_text(str(pid))


def _empty_cgroup(group: Path, root: Path) -> list[int]:
    """Move every process of `group` to the root cgroup and remove it; returns their pids."""
    moved = []
    with contextlib.suppress(FileNotFoundError):
        for pid in (group / "cgroup.procs").read_text().split():
            _move(int(pid), root)
            moved.append(int(pid))
    for _ in range(50):  # a moved process leaves the group a moment later
        try:
            group.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.02)
    return moved


def _connections(pids: set[int]) -> list[tuple[int, int, int]]:
    """(local port, remote port, owner pid) of every TCP socket of `pids` that has a peer."""
    listed = subprocess.run(
        ["ss", "-H", "-t", "-a", "-n", "-p"], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in listed.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[0] == "LISTEN":
            continue
        local, remote = fields[3].rsplit(":", 1)[1], fields[4].rsplit(":", 1)[1]
        if remote == "*":
            continue
        for owner in re.findall(r"pid=(\d+)", " ".join(fields[5:])):
            if int(owner) in pids:
                found.append((int(local), int(remote), int(owner)))
    return found


def _open_between(inside: Sequence[Peer], outside: Sequence[Peer]) -> set[tuple[int, int]]:
    """The connections between a process of one side and one of the other, as (port, port):
    one end owned by a side's process, the other a port the other side listens on or a socket
    the other side owns."""
    side = {p.pid: "in" for p in inside} | {p.pid: "out" for p in outside}
    listening = {port: "in" for p in inside for port in p.ports} | {
        port: "out" for p in outside for port in p.ports
    }
    sockets = _connections(set(side))
    owner_of = {(local, remote): side[pid] for local, remote, pid in sockets}
    between = set()
    for local, remote, pid in sockets:
        other = owner_of.get((remote, local)) or listening.get(remote)
        if other is not None and other != side[pid]:
            between.add((local, remote))
    return between


def _drop(tag: str, *matches: str) -> list[str]:
    """An OUTPUT rule on loopback; its comment is the suite's with the pid, then the rule's tag
    (letters, digits and `_` only: iptables -S prints such a comment unquoted)."""
    comment = f"{COMMENT_PREFIX}-{os.getpid()}-{tag}"
    return ["OUTPUT", "-o", "lo", "-p", "tcp", *matches, "-m", "comment", "--comment", comment,
            "-j", "DROP"]  # fmt: skip


@contextmanager
def isolate(inside: Sequence[Peer], outside: Sequence[Peer]) -> Iterator[Isolation]:
    """Cut the processes `inside` off from the processes `outside` (every TCP packet between
    them dropped both ways, no RST, no FIN) while the block runs; every other process (clients)
    still reaches both sides, and a side's processes still reach each other.

    How: loopback packets are all locally generated, so each passes OUTPUT with the socket that
    sent it, and `-m cgroup --path` matches that socket's cgroup2 group. Each side's processes
    are moved into a cgroup of their own, and the packets sent from one side's cgroup to a port
    the other side listens on are dropped: a connection one side opens to the other hangs in
    SYN-SENT. A socket keeps the cgroup of the process that created it, though (measured: a
    socket opened before the move is not matched, and a listener's accepted sockets carry the
    listener's cgroup), so the connections already open between the sides are listed (`ss`)
    and each is cut by its pair of ports, both directions, after the move and the cgroup rules;
    a second listing 0.2 s later catches a socket created before the move that connected after
    the first (one connecting later still would slip through). At the end the rules go, then
    the processes go back to their own cgroups.

    A port pair stays cut for the whole block: a client connection that happens to get the same
    ephemeral port to the same server port (both ends are 127.0.0.1; ~30 pairs among ~28,000
    ephemeral ports) would be cut too, and would have to reconnect."""
    _entering()
    root = _cgroup2_root()
    if root is None:
        raise RuntimeError("no cgroup2 hierarchy mounted (isolate matches sockets by cgroup2)")
    base = f"{COMMENT_PREFIX}-{os.getpid()}-{time.monotonic_ns()}"
    groups = {"inside": root / f"{base}-inside", "outside": root / f"{base}-outside"}
    isolation = Isolation(tuple(inside), tuple(outside), groups)
    homes = {peer.pid: _cgroup_of(peer.pid, root) for peer in (*inside, *outside)}
    inserted: list[list[str]] = []

    def insert(tag: str, *matches: str) -> None:
        spec = _drop(tag, *matches)
        result = _iptables("-I", *spec)
        if result.returncode != 0:
            raise RuntimeError(f"iptables -I {' '.join(spec)}: {result.stderr.strip()}")
        inserted.append(spec)
        isolation._tags.append(tag)

    def cut(pairs: Iterable[tuple[int, int]]) -> None:
        for a, b in sorted(set(pairs) - isolation.cut - {(b, a) for a, b in isolation.cut}):
            insert(f"cut_{a}_to_{b}", "--sport", str(a), "--dport", str(b))
            insert(f"cut_{b}_to_{a}", "--sport", str(b), "--dport", str(a))
            isolation.cut.add((a, b))

    try:
        for group in groups.values():
            group.mkdir()
        for name, peers, others in (("inside", inside, outside), ("outside", outside, inside)):
            for peer in peers:
                _move(peer.pid, groups[name])
            for port in sorted({port for other in others for port in other.ports}):
                insert(f"{name}_to_{port}", "-m", "cgroup", "--path", groups[name].name,
                       "--dport", str(port))  # fmt: skip
        cut(_open_between(inside, outside))
        time.sleep(0.2)
        cut(_open_between(inside, outside))
        yield isolation
    finally:
        failures = _delete(inserted)
        for pid, home in homes.items():
            _move(pid, home if home.is_dir() else root)
        for group in groups.values():
            if group.is_dir():
                _empty_cgroup(group, root)
        if failures:
            raise RuntimeError(failures)
