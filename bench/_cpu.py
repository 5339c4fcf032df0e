"""CPU-seconds of one benchmark's processes, read from /proc while a phase runs.

Why not wall time or the machine's CPU: the 2-core machine is shared, so both include other
people's work. The processes doing this benchmark's work are known: its own descendants (drain
workers, `pin` commands, the private Kafka broker, `pin serve` and every process Dagster starts),
and the PostgreSQL backends connected to its databases, with their parallel workers and the
autovacuum workers in those databases. Their CPU is what a unit of work costs, whatever else runs.

A process counts from its first sample in the phase (one alive at the start: from the start; one
started later: its whole life, since /proc counts from its start). A process that exits between
two samples loses what it used after the last one: at most SAMPLE_SECONDS per process, so a
backend that lives a few milliseconds (a connection per operation) is mostly missed. A process is
its pid AND its start time: pids wrap (32768 here) within minutes on a busy machine, and a reused
pid must not carry someone else's CPU into a total.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

#: Tracked processes are read this often; new PostgreSQL backends are looked for as often.
SAMPLE_SECONDS = 0.05
#: Descendants below the benchmark's own children are looked for this often (a scan of every
#: process); its children are looked for at every sample.
DESCENDANT_SCAN_SECONDS = 0.25


def _process_clock(pid: int) -> int:
    """The clock id of `pid`'s CPU time (all its threads), as glibc's clock_getcpuclockid makes
    it (Linux's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)), which Python does not expose."""
    return ((~pid) << 3) | 2


def proc_stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, CPU seconds so far, start time in ticks), or None once the process is gone.

    The CPU from the process's CPU clock (the scheduler's nanoseconds), not /proc's utime +
    stime: those are whole clock ticks (10 ms) rounded down, a bias of ~5 ms per process that is
    a tenth of what a drain tick's backend uses."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        cpu = time.clock_gettime(_process_clock(pid))
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), cpu, int(fields[19])


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU-seconds of `pid` so far (its whole life), or None once it is gone (or not on this
    machine). Read just before a connection closes, it is all its PostgreSQL backend used."""
    found = proc_stat(pid)
    return found[1] if found else None


def proc_cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def proc_children(pid: int) -> list[int]:
    """The children of `pid`, from every one of its threads' /proc children lists (none when it
    is gone)."""
    found: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                found += map(int, Path(task.path, "children").read_text().split())
            except OSError:
                continue
    except OSError:
        pass
    return found


def postmaster_pid(backend_pid: int) -> int | None:
    """The PostgreSQL server's main process, from one backend's pid; None when the server is not
    on this machine (then only the benchmark's own processes are measured)."""
    found = proc_stat(backend_pid)
    return found[0] if found else None


def descendant_kind(cmdline: str) -> str:
    if "kafka.Kafka" in cmdline:
        return "kafka"
    if "dagster" in cmdline or cmdline.split()[-2:] == ["pin_pipelines.cli", "serve"]:
        return "dagster"
    return "python"


@dataclass
class _Process:
    kind: str
    started: int  # ticks since boot: with the pid, the process's identity
    first: float  # CPU seconds when the phase began for it (0 for one started in the phase)
    last: float


class CpuMeter:
    """Samples until closed; `totals()` (CPU seconds by kind) may be read at any time.

    Kinds: `postgres` and the other values of `databases` (backends of those databases and their
    parallel workers), `autovacuum` (autovacuum workers in them), `python` (the benchmark's
    processes), `dagster`, `kafka`, and whatever `relabel` assigns.
    """

    def __init__(self, databases: Mapping[str, str], server_pid: int | None) -> None:
        self._databases = dict(databases)
        self._server_pid = server_pid
        self._live: dict[int, _Process] = {}
        #: CPU seconds of the processes that ended, by kind.
        self._ended: dict[str, float] = defaultdict(float)
        #: Server children that are not this benchmark's (forgotten once they end).
        self._ignored: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        self._scan_descendants(start=True)
        self._scan_backends(start=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def relabel(self, pid: int, kind: str) -> None:
        """Counts `pid` (e.g. the backend of the edit load) under `kind`, its CPU so far
        included."""
        with self._lock:
            if pid in self._live:
                self._live[pid].kind = kind
                return
        self._track(pid, kind, start=False)

    def pids(self, kind: str) -> list[int]:
        with self._lock:
            return [pid for pid, p in self._live.items() if p.kind == kind]

    def totals(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = defaultdict(float, self._ended)
            for p in self._live.values():
                out[p.kind] += p.last - p.first
            return {kind: round(seconds, 3) for kind, seconds in sorted(out.items())}

    def _run(self) -> None:
        since_scan = 0.0
        while not self._stop.wait(SAMPLE_SECONDS):
            since_scan += SAMPLE_SECONDS
            if since_scan >= DESCENDANT_SCAN_SECONDS:
                since_scan = 0.0
                self._scan_descendants(start=False)
            self._scan_children()
            self._scan_backends(start=False)
            self._sample()

    def _track(self, pid: int, kind: str, start: bool) -> None:
        """Starts following `pid`, or gives a followed one its final kind."""
        found = proc_stat(pid)
        if found is None:
            return
        with self._lock:
            known = self._live.get(pid)
            if known is not None and known.started == found[2]:
                known.kind = kind
                return
            # Alive before the phase: only what it uses from now on counts.
            first = found[1] if start else 0.0
            self._live[pid] = _Process(kind, found[2], first, found[1])

    def _unexamined(self, pid: int) -> bool:
        """Not followed yet, or followed as `python` (seen between fork and exec, when a child
        still shows its parent's command line: looked at again until it shows its own)."""
        known = self._live.get(pid)
        return known is None or known.kind == "python"

    def _scan_descendants(self, start: bool) -> None:
        parents: dict[int, list[int]] = defaultdict(list)
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                found = proc_stat(int(entry.name))
                if found:
                    parents[found[0]].append(int(entry.name))
        todo = [os.getpid()]
        while todo:
            parent = todo.pop()
            for child in parents.get(parent, []):
                todo.append(child)
                if self._unexamined(child):
                    self._track(child, self._child_kind(parent, child), start)

    def _scan_children(self) -> None:
        """This process's own children, at every sample: a short-lived worker or `pin` command
        is seen even when it ends before the next scan of every process."""
        for child in proc_children(os.getpid()):
            if self._unexamined(child):
                self._track(child, self._child_kind(os.getpid(), child), start=False)

    def _child_kind(self, parent: int, child: int) -> str:
        """What Dagster starts is Dagster's, whatever its command line (its code server runs
        schedules in `multiprocessing` children)."""
        kind = descendant_kind(proc_cmdline(child))
        known = self._live.get(parent)
        return "dagster" if kind == "python" and known and known.kind == "dagster" else kind

    def _scan_backends(self, start: bool) -> None:
        if self._server_pid is None:
            return
        children = proc_children(self._server_pid)
        self._ignored &= set(children)
        for pid in children:
            if pid in self._live or pid in self._ignored:
                continue
            title = proc_cmdline(pid)
            if not title.startswith("postgres: "):
                continue  # forked, not yet named: looked at again on the next scan
            kind = self._backend_kind(title)
            if kind is None:
                self._ignored.add(pid)
            else:
                self._track(pid, kind, start)

    def _backend_kind(self, title: str) -> str | None:
        """From the process title: `postgres: <user> <database> <client> <state>`,
        `postgres: autovacuum worker <database>`, `postgres: parallel worker for PID <leader>`."""
        words = title.split()
        if title.startswith("postgres: autovacuum worker"):
            return "autovacuum" if len(words) > 3 and words[3] in self._databases else None
        if title.startswith("postgres: parallel worker for PID"):
            leader = self._live.get(int(words[-1])) if words[-1].isdigit() else None
            return leader.kind if leader else None
        if len(words) >= 4 and words[2] in self._databases:
            return self._databases[words[2]]
        return None

    def _sample(self) -> None:
        with self._lock:
            followed = list(self._live.items())
        for pid, process in followed:
            found = proc_stat(pid)
            with self._lock:
                if found is None or found[2] != process.started:
                    # Ended (its pid may already be someone else's): what it used is final.
                    self._ended[process.kind] += process.last - process.first
                    if self._live.get(pid) is process:
                        del self._live[pid]
                else:
                    process.last = found[1]
