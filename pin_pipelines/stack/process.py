"""Detached service processes with pid files, and the installers they fall back on.

Written by hand rather than with a supervisor library: each service needs only start-detached,
is-alive and stop-with-grace, and a supervisor daemon would be one more process to keep alive.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pin_pipelines.errors import PinError
from pin_pipelines.signals import default_stop_signals


def started_at(pid: int) -> int | None:
    """When live process `pid` started (clock ticks since boot), or None: gone, a zombie, or the
    id of another process's thread. Threads draw their ids from the pids' counter, and /proc and
    kill(2) answer to a thread's id as to a process's: a CI run's servers start and end threads
    by the thousand, so a dead service's pid is soon some thread's."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # pid (comm) state … field 22 starttime: comm may hold spaces and parentheses.
            fields = stat.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/status", "rb") as status:
            leader = f"\nTgid:\t{pid}\n".encode() in status.read()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z" or not leader:  # a zombie child of ours is gone too
        return None
    return int(fields[19])


def pid_alive(pid: int) -> bool:
    """Whether a live process (not a thread, not a zombie) has id `pid`."""
    return started_at(pid) is not None


def read_pid(pidfile: Path) -> int | None:
    """The pid in `pidfile` when that process still runs: the same process, by its start time
    (the file holds both), not whichever process or thread has the id now."""
    try:
        pid, _, start = pidfile.read_text().strip().partition(" ")
        recorded = int(pid), int(start) if start else None
    except (OSError, ValueError):
        return None
    now = started_at(recorded[0])
    # A file without a start time (written before the file held one): any process with the id.
    alive = now is not None and recorded[1] in (None, now)
    return recorded[0] if alive else None


def _still(pid: int, start: int | None) -> bool:
    """Whether process `pid` that started at `start` runs (`start` None: it did not run)."""
    return start is not None and started_at(pid) == start


#: The services this process started, by pid, until their start is confirmed or has failed: how
#: one that died while starting ended (an exit code, or the signal that killed it) is known only
#: to its parent, and only while nothing else has reaped it (`subprocess` reaps a dropped Popen's
#: child at the next Popen of the process).
_STARTING: dict[int, subprocess.Popen[bytes]] = {}


def start_detached(
    argv: Sequence[str],
    *,
    pidfile: Path,
    logfile: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Start `argv` in its own session (it outlives this process), output appended to `logfile`."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=default_stop_signals,
        )
    _STARTING[proc.pid] = proc
    # Its start time is set at the fork, and the unreaped child keeps its id: read now, it is
    # this process's (None: it already ended, and 0 matches no process).
    pidfile.write_text(f"{proc.pid} {started_at(proc.pid) or 0}\n")
    return proc.pid


def _how_it_ended(pid: int) -> str:
    """How service `pid`, started by this process and found dead, ended: " (exit code N)", " (killed
    by SIGX)", or "" when this process did not start it."""
    proc = _STARTING.pop(pid, None)
    if proc is None:
        return ""
    try:
        code = proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        return ""
    if code < 0:
        return f" (killed by {signal.Signals(-code).name})"
    return f" (exit code {code})"


def stop_child(process: subprocess.Popen[Any], *, grace_seconds: float) -> None:
    """SIGTERM a child this process started, then SIGKILL it after the grace period; reaped."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_pid(pidfile: Path, *, grace_seconds: float = 30.0) -> bool:
    """SIGTERM, then SIGKILL after the grace period. Returns whether a process was running."""
    pid = read_pid(pidfile)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    start = started_at(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while _still(pid, start) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _still(pid, start):  # not a process that took its id since
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    return True


def wait_until(
    check: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    logfile: Path | None = None,
    pid: int | None = None,
    output: Path | None = None,
) -> float:
    """Poll `check` until true; returns the seconds it took, or raises with the log's tail.

    `output` is where process `pid` writes its stdout and stderr: when it exits during start-up,
    its last words are there (a JVM's, or a child's that died before its exec), while `logfile`
    may still end with the previous run's lines."""
    start = time.monotonic()
    began = None if pid is None else started_at(pid)
    while time.monotonic() - start < timeout:
        if check():
            if pid is not None:
                _STARTING.pop(pid, None)  # started: its Popen may go (subprocess reaps it)
            return time.monotonic() - start
        if pid is not None and not _still(pid, began):
            ended = _how_it_ended(pid)
            raise PinError(
                f"{what} exited during start-up{ended}{_log_tail(output)}{_log_tail(logfile)}"
            )
        time.sleep(0.2)
    if pid is not None:
        _STARTING.pop(pid, None)
    raise PinError(f"{what} did not answer within {timeout:.0f}s{_log_tail(logfile)}")


#: A stack trace's frame line: ClickHouse's "12. /lib/…(…) [0x…]", Java's "at …". A server that
#: dies at its start ends its log with a trace: its message is the line before the frames.
STACK_FRAME = re.compile(r"^\s*(\d+\. |at |\.\.\. \d+ more)")


def _log_tail(logfile: Path | None, lines: int = 5) -> str:
    """The log's last `lines` lines that are not stack frames, or "" without a log."""
    if logfile is None or not logfile.exists():
        return ""
    text = logfile.read_text(errors="replace").strip().splitlines()
    tail = [line.strip() for line in text if line.strip() and not STACK_FRAME.match(line)]
    return f"; see {logfile}: " + " | ".join(tail[-lines:])


def apt_install(packages: Sequence[str]) -> None:
    """Install Debian packages; the project's own scripts bring every service they start."""
    if shutil.which("apt-get") is None:
        raise PinError(f"cannot install {', '.join(packages)}: apt-get is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    for argv in (
        [*prefix, "apt-get", "update", "-qq"],
        [*prefix, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise PinError(f"`{' '.join(argv)}` failed: {last[0]}")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


#: Where private servers' ports come from: below the kernel's ephemeral range. A port in that
#: range, left free by a server's restart, can meanwhile become the local port of any outgoing
#: connection, and the restarted server then fails to bind it (a CI run lost a ClickHouse replica
#: after its kill -9 that way: its port was 48704).
PRIVATE_PORTS_FROM = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_port_choice = random.Random()  # its own: hypothesis reseeds the module's generator in tests
#: Handed out by this process: two servers of one test never get the same port.
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on right now (for a private server or a refused call)."""
    return free_port_run(1)


def free_port_run(length: int) -> int:
    """The first of `length` consecutive loopback ports free right now, none of them handed out
    before by this process: a private cluster's nodes take their ports from one base (a broker
    and its controller, a server's native, HTTP and interserver ports)."""
    ephemeral_from = int(EPHEMERAL_RANGE.read_text().split()[0])
    while True:
        base = _port_choice.randrange(PRIVATE_PORTS_FROM, ephemeral_from - length)
        run = range(base, base + length)
        if _handed_out.intersection(run):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in run:
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.update(run)
        return base
