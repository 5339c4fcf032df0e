"""The sweeper of `pin serve` and `pin dev`: a small process that outlives them, to kill whatever
they leave running when they are killed themselves.

`pin serve` stops its children on every stop it is told of (serve.py). A SIGKILL (an operator's
`kill -9`, the OOM killer) gives it no chance: its dagster-daemon and dagster-webserver, each in a
process group of its own so that Ctrl-C reaches `pin serve` alone, were reparented to init and
went on running with their code servers and run workers. A code server whose parent is gone ends
only once its run workers have ended, and never if its cleanup thread died on a storage error
(Dagster 1.13's `DagsterApiServer._check_for_orphaned_runs`).

`pin serve` starts this process in a process group of its own, with a pipe on its stdin whose
only write end `pin serve` holds, and writes each child's process group to it. When the pipe ends
(EOF: `pin serve` is gone, however it went), every process still in those groups and in this
session is SIGKILLed (Dagster's processes stay in the group of the child that started them), and
the sweeper exits. After a clean stop nothing is left in them, and it exits at once.

Run as `python -m pin_pipelines.sweeper <pid of pin serve>`; it imports nothing of the project,
so that it starts fast and nothing can make it fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

#: Killing stops here even if something is still left (a process stuck in the kernel).
SWEEP_SECONDS = 10.0


def members(groups: set[int], session: int) -> dict[int, str]:
    """The live processes (not zombies) of `groups` in `session`, this one excepted: their
    command lines by pid. The session too, so that a group id reused by an unrelated process
    elsewhere is never hit."""
    found = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                # pid (comm) state ppid pgrp session …: comm may hold spaces and parentheses.
                fields = stat.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z" or int(fields[2]) not in groups or int(fields[3]) != session:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        found[int(name)] = command
    return found


def sweep(groups: set[int], session: int, seconds: float = SWEEP_SECONDS) -> dict[int, str]:
    """SIGKILL every member of `groups` in `session` until none is left (or `seconds` pass: one
    may fork while it is being killed); what was killed."""
    killed: dict[int, str] = {}
    deadline = time.monotonic() + seconds
    while (left := members(groups, session)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(left)
        time.sleep(0.05)
    return killed


def main() -> None:
    # Its own process group keeps Ctrl-C and a signal to `pin serve`'s group away from it. A
    # terminal's hang-up kills `pin serve` (the foreground group's SIGHUP): not this process,
    # which then does its work. SIGTERM and SIGINT sent to it end it, as they end every process
    # of `pin serve` that was not told otherwise.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    owner = sys.argv[1] if len(sys.argv) > 1 else "?"
    groups = set()
    for line in sys.stdin.buffer:  # until EOF: the owner is gone
        with contextlib.suppress(ValueError):
            groups.add(int(line))
    killed = sweep(groups, os.getsid(0))
    if killed:
        print(
            f"pin: process {owner} is gone; killed the {len(killed)} processes it left: "
            + "; ".join(f"{pid} {command[:120]}" for pid, command in sorted(killed.items())),
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
