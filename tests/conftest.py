"""Guards of the whole suite, unit tests included: every test leaves the process as it found it,
the SIGINT and SIGTERM dispositions, and no child process alive (a leftover `pin` outlived CI
once).

Nothing here needs a service: the fixtures of the real local services are session fixtures of
tests/support (registered below), which start nothing until a test asks for them, and only the
conftests of tests/integration and tests/e2e point `pin`'s environment at them, so tests/unit runs
with none up.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest

from tests.support.blackhole import remove_leftover_rules

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


def _processes() -> list[_Process]:
    """Every process this one can see, from /proc (gone ones skipped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid pgrp session …: comm may hold spaces and parentheses.
            state, ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
            found.append(_Process(int(entry.name), int(ppid), int(session), state == "Z"))
    return found


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return b" ".join(argv).decode(errors="replace").strip()


def _live_children() -> set[int]:
    """This process's live children, except those in a session of their own: `start_detached`
    (pin_pipelines/stack/process.py) starts a service that way on purpose, to outlive its
    starter (`pin stack up`; a test's private ClickHouse server, which its fixture stops).
    Zombies have exited already."""
    me, session = os.getpid(), os.getsid(0)
    return {p.pid for p in _processes() if p.ppid == me and p.session == session and not p.zombie}


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


def _leftovers(before: set[int]) -> str:
    """Kill the live children not in `before`; describe them (empty when there were none)."""
    left = {pid: _command(pid) for pid in _live_children() - before}
    _kill_with_descendants(set(left))
    return "; ".join(f"pid {pid}: {command}" for pid, command in sorted(left.items()))


@pytest.fixture(autouse=True)
def _no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test (fixtures included) that leaves a child process alive, and kills it, so that
    nothing a test starts outlives the run."""
    before = _live_children()
    yield
    left = _leftovers(before)
    if left:
        pytest.fail(f"{request.node.nodeid} left processes alive (killed): {left}", pytrace=False)


@pytest.fixture(autouse=True)
def _no_blackhole_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves a partition rule of tests/support/blackhole.py in iptables, and
    deletes it: a leftover DROP cuts every later test (and the machine's services) off."""
    yield
    left = remove_leftover_rules()
    if left:
        pytest.fail(
            f"{request.node.nodeid} left iptables rules (deleted): {'; '.join(left)}", pytrace=False
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The same at the end, after the last finalizers: children of module- or session-scoped
    fixtures, started before any one test's check began, fail the run here."""
    left = _leftovers(set())
    if left:
        print(f"\nprocesses left alive at the end of the session (killed): {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
