"""Guards of the whole suite, unit tests included: every test leaves the process as it found it,
the SIGINT and SIGTERM dispositions, no child process alive (a leftover `pin` outlived CI once),
and no orphaned process of the run (a Dagster code server outlived CI by 51 minutes once,
re-parented to init when its daemon exited).

Nothing here needs a service: the fixtures of the real local services are session fixtures of
tests/support (registered below), which start nothing until a test asks for them, and only the
conftests of tests/integration and tests/e2e point `pin`'s environment at them, so tests/unit runs
with none up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest

from tests.support.blackhole import blocks_entered, remove_leftover_rules

#: The parallel lanes' order of modules (bin/test runs the suite on pytest-xdist workers), and
#: the fixtures of the services, shared or the session's own (available to every test module):
#: the test database, the shared and the private brokers, the private Kafka cluster, the
#: ClickHouse paths, the secured estate of `pin stack up --secure`.
pytest_plugins = [
    "tests.support.lanes",
    "tests.support.database",
    "tests.support.shared_kafka",
    "tests.support.private_kafka",
    "tests.support.kafka_cluster",
    "tests.support.clickhouse",
    "tests.support.devstats_dagster",
    "tests.support.secured",
]

# --- process hygiene ------------------------------------------------------------------------------

#: What `signal.getsignal` may answer: a handler, SIG_DFL/SIG_IGN, or None (set outside Python).
Disposition = Callable[[int, FrameType | None], object] | int | None
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT raises KeyboardInterrupt, and SIGTERM does the same, for the whole session.

    Dagster's in-process execution (`capture_interrupts`, used by `materialize` and
    `execute_in_process`) ends by giving SIGTERM whatever SIGINT has. CI started pytest with
    SIGINT and SIGQUIT ignored (as a shell starts a background job), so after the first Dagster
    test SIGTERM was ignored too, and every process a later test started inherited that: `pin
    metrics serve` ignored the test's SIGTERM and outlived the run. SIGINT gets Python's own
    handler back, and SIGTERM gets it up front, so Dagster's copy changes nothing, a caught
    signal is reset to its default in every child, and a SIGTERM to pytest (a CI timeout)
    unwinds through the fixtures' finalizers, which stop what the tests started.
    """
    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt in (signal.SIG_IGN, signal.SIG_DFL, None):
        interrupt = signal.default_int_handler
        signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    _mark_the_run()


def _kernel_ignored() -> frozenset[int]:
    """SIGINT/SIGTERM as ignored by the kernel (/proc/self/status SigIgn): a C library can
    ignore a signal behind the back of Python's `signal.getsignal`."""
    status = Path("/proc/self/status").read_text()
    mask = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn")), 16
    )
    return frozenset(sig for sig in INTERRUPTS if mask >> (sig - 1) & 1)


@pytest.fixture(autouse=True)
def _interrupt_dispositions_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test (fixtures included) that leaves SIGINT's or SIGTERM's disposition changed,
    and restores it: a changed disposition is inherited by every process a later test starts."""
    before: dict[int, Disposition] = {sig: signal.getsignal(sig) for sig in INTERRUPTS}
    ignored = _kernel_ignored()
    yield
    changed = [
        f"{signal.Signals(sig).name} {before[sig]!r} -> {signal.getsignal(sig)!r}"
        for sig in INTERRUPTS
        if signal.getsignal(sig) != before[sig]
    ]
    changed += [
        f"{signal.Signals(sig).name} {'no longer' if sig in ignored else 'now'} ignored (SigIgn)"
        for sig in ignored.symmetric_difference(_kernel_ignored())
    ]
    if changed:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        pytest.fail(
            f"{request.node.nodeid} left signal dispositions changed (restored): "
            + "; ".join(changed),
            pytrace=False,
        )


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    session: int
    zombie: bool
    #: Clock ticks after boot (stat's field 22): with the pid, one process even if pids wrap.
    start: int


def _processes() -> list[_Process]:
    """Every process this one can see, from /proc (gone ones skipped)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            # pid (comm) state ppid pgrp session … starttime (22nd): comm may hold spaces and
            # parentheses.
            state, ppid, session, start = fields[0], fields[1], fields[3], fields[19]
            found.append(_Process(int(name), int(ppid), int(session), state == b"Z", int(start)))
    return found


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return b" ".join(argv).decode(errors="replace").strip()


def _live_children(processes: list[_Process] | None = None) -> set[int]:
    """This process's live children, except those in a session of their own: `start_detached`
    (pin_pipelines/stack/process.py) starts a service that way on purpose, to outlive its
    starter (`pin stack up`; a test's private ClickHouse server, which its fixture stops).
    Zombies have exited already."""
    me, session = os.getpid(), os.getsid(0)
    return {
        p.pid
        for p in (_processes() if processes is None else processes)
        if p.ppid == me and p.session == session and not p.zombie
    }


# --- orphans of the run ---------------------------------------------------------------------------

#: Every process the tests start inherits this variable, set by pytest_configure: the run's id,
#: the xdist worker (PYTEST_XDIST_WORKER: workers of one run run at once) and this pytest's pid.
RUN_MARK = "PIN_TEST_RUN"
#: An orphan found after a test gets this long to end by itself (a process whose parent just
#: exited may be on its way out) before it is killed and the test fails.
ORPHAN_GRACE_SECONDS = 3.0


def _mark_the_run() -> None:
    """Put this pytest's mark in its environment, which every process it starts inherits (one
    started with an environment of its own making escapes the check). An xdist worker keeps its
    controller's run id."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    inherited = os.environ.get(RUN_MARK, "")
    run = inherited.split("/")[0] if worker and inherited else uuid.uuid4().hex[:12]
    os.environ[RUN_MARK] = f"{run}/{worker or 'main'}/{os.getpid()}"


class _Orphans:
    """The processes of this run (carrying this pytest's mark) that are no longer below it: the
    topmost of each such tree, whose parent does not carry the mark (init, or a subreaper
    outside the run, adopted it when its own parent died).

    One /proc scan finds them: only a process outside this one's tree, started after it, has its
    /proc/PID/environ read, once (cached by pid and start time). A process that overwrites its
    environment's memory (PostgreSQL's process titles) shows no mark."""

    def __init__(self) -> None:
        self.mark = f"\0{RUN_MARK}={os.environ[RUN_MARK]}\0".encode()
        me = os.getpid()
        self.since = next(p.start for p in _processes() if p.pid == me)
        self.carriers: dict[tuple[int, int], bool] = {}

    def carries(self, process: _Process) -> bool:
        if process.start < self.since:
            return False
        key = (process.pid, process.start)
        if key not in self.carriers:
            try:
                environ = b"\0" + Path(f"/proc/{process.pid}/environ").read_bytes()
            except OSError:
                environ = b""
            self.carriers[key] = self.mark in environ
        return self.carriers[key]

    def find(self, processes: list[_Process]) -> list[_Process]:
        me = os.getpid()
        children: dict[int, list[int]] = {}
        for process in processes:
            children.setdefault(process.ppid, []).append(process.pid)
        below: set[int] = set()
        frontier = [me]
        while frontier:
            frontier = [child for pid in frontier for child in children.get(pid, [])]
            below.update(frontier)
        by_pid = {p.pid: p for p in processes}
        found = []
        for process in processes:
            if process.pid == me or process.pid in below or process.zombie:
                continue
            if not self.carries(process):
                continue
            parent = by_pid.get(process.ppid)
            if parent is not None and not parent.zombie and self.carries(parent):
                continue  # below an orphan found at its top
            found.append(process)
        live = {(p.pid, p.start) for p in processes}
        self.carriers = {key: known for key, known in self.carriers.items() if key in live}
        return found


_orphans: _Orphans | None = None


def _orphans_left(processes: list[_Process], *, detached_under: Path | None = None) -> str:
    """Kill the orphans of the run (with their descendants) still alive after their grace;
    describe them (empty when there were none).

    A session leader (`start_detached`, pg_ctl) is a service started detached on purpose: a
    module- or session-scoped fixture may hold it across tests, and one of the shared stack
    that a test's `pin stack up` restarted is the stack's, meant to outlive the run. It counts
    only at the end of the session, and only if its command line or working directory lies
    under `detached_under` (the session's temporary folder: a private server of the run)."""
    global _orphans
    if _orphans is None:
        _orphans = _Orphans()

    def counts(process: _Process) -> bool:
        if process.session != process.pid:
            return True
        return detached_under is not None and _lies_under(process.pid, detached_under)

    deadline = time.monotonic() + ORPHAN_GRACE_SECONDS
    while True:
        found = [p for p in _orphans.find(processes) if counts(p)]
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
        processes = _processes()
    left = {p.pid: _command(p.pid) for p in found}
    _kill_with_descendants(set(left))
    return "; ".join(f"pid {pid}: {command}" for pid, command in sorted(left.items()))


def _kill_with_descendants(pids: set[int]) -> None:
    """SIGKILL (a leftover may ignore SIGTERM: that is how one outlived CI), descendants too, and
    reap the direct children."""
    processes = _processes()
    doomed, grew = set(pids), True
    while grew:
        more = {p.pid for p in processes if p.ppid in doomed} - doomed
        doomed |= more
        grew = bool(more)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):  # reaped meanwhile by its Popen object
            os.waitpid(pid, 0)


def _leftovers(before: set[int], processes: list[_Process] | None = None) -> str:
    """Kill the live children not in `before`; describe them (empty when there were none)."""
    left = {pid: _command(pid) for pid in _live_children(processes) - before}
    _kill_with_descendants(set(left))
    return "; ".join(f"pid {pid}: {command}" for pid, command in sorted(left.items()))


def _lies_under(pid: int, folder: Path) -> bool:
    """Whether the process's command line or working directory names a path under `folder`."""
    with contextlib.suppress(OSError):
        if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(folder):
            return True
    return f"{folder}/" in _command(pid)


@pytest.fixture(autouse=True)
def _no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test (fixtures included) that leaves a child process alive, or an orphaned
    process of the run (one it started whose parent died, a grandchild of this process
    included), and kills them, so that nothing a test starts outlives the run. One /proc scan
    before the test and one after."""
    before = _live_children()
    yield
    processes = _processes()
    left = _leftovers(before, processes)
    orphans = _orphans_left(processes)
    failures = []
    if left:
        failures.append(f"left processes alive (killed): {left}")
    if orphans:
        failures.append(f"left orphaned processes, re-parented outside the run (killed): {orphans}")
    if failures:
        pytest.fail(f"{request.node.nodeid} {'; '.join(failures)}", pytrace=False)


@pytest.fixture(autouse=True)
def _no_blackhole_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves a partition rule of tests/support/blackhole.py in iptables, and
    deletes it: a leftover DROP cuts every later test (and the machine's services) off. Looked
    for only after a test that entered a block of blackhole.py (its counter), and at the end."""
    entered = blocks_entered()
    yield
    if blocks_entered() == entered:
        return
    left = remove_leftover_rules()
    if left:
        pytest.fail(
            f"{request.node.nodeid} left iptables rules (deleted): {'; '.join(left)}", pytrace=False
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The same at the end, after the last finalizers: children of module- or session-scoped
    fixtures, started before any one test's check began, fail the run here, and so does an
    orphan of the run, a private service started detached included (one under the session's
    temporary folder), and a partition rule left by this process or by a dead one (a test
    process killed inside its block)."""
    processes = _processes()
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)  # None: no test made a temporary folder
    problems = {
        "processes left alive at the end of the session (killed)": _leftovers(set(), processes),
        "orphaned processes of the run at the end of the session (killed)": _orphans_left(
            processes, detached_under=basetemp
        ),
        "iptables rules left at the end of the session (deleted)": "; ".join(
            remove_leftover_rules()
        ),
    }
    for what, left in problems.items():
        if left:
            print(f"\n{what}: {left}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
