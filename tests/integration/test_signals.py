"""`pin`'s long-running commands stop on SIGTERM and SIGINT even when started with
both ignored, and the test suite neither ignores SIGTERM nor leaves a process behind.

The baseline CI run left `pin metrics serve` running 14 minutes after it ended, with SigIgn
0x1005006: pytest had been started with SIGINT and SIGQUIT ignored, a Dagster test's in-process
execution copied SIGINT's disposition onto SIGTERM, and the exporter inherited both ignored.
Every process here is started with SIGTERM and SIGINT ignored, as it was then.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from dagster_graphql import DagsterGraphQLClient

from pin_pipelines.config import dagster_pg_url_from, dsn_with_dbname
from pin_pipelines.stack.process import free_port, pid_alive, port_open, start_detached
from tests.support.blackhole import remove_leftover_rules
from tests.support.chessboard import (
    make_all_due,
    make_building,
    make_layout,
    make_object,
    make_project,
)
from tests.support.http import answers_http
from tests.support.pg import dbname
from tests.support.recalc import (
    PIN,
    REPO_ROOT,
    last_json_line,
    pin_env,
    queued_projects,
    sleeping_backends,
    slow_recalc,
)
from tests.support.serve import kill_session, session_pids, session_processes, submit_run

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SIGNAL_IDS = [s.name for s in STOP_SIGNALS]


def ignore_stop_signals() -> None:
    """preexec_fn: what the leftover exporter inherited from its test process."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def ignores(pid: int) -> list[str]:
    """Which of SIGTERM and SIGINT the process ignores, from its /proc status (should be none)."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.MULTILINE)
    assert found, status
    mask = int(found[1], 16)
    return [s.name for s in STOP_SIGNALS if mask >> (s - 1) & 1]


def resource_trackers(sid: int) -> list[int]:
    """Pids of the session's multiprocessing resource trackers: the standard library's
    `resource_tracker.main` sets SIGINT and SIGTERM to SIG_IGN itself, so that it outlives the
    processes whose semaphores it cleans up; it exits when the last of them closes its pipe."""
    return [
        int(line.split(":", 1)[0])
        for line in session_processes(sid)
        if "from multiprocessing.resource_tracker import main" in line
    ]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@dataclass
class Started:
    """A `pin` process; its output goes to files, which a chatty child cannot fill up."""

    process: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, signum: signal.Signals, timeout: float) -> float:
        """Send `signum`; the seconds until the process exited (fails after `timeout`)."""
        sent = time.monotonic()
        self.process.send_signal(signum)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout:.0f} s after {signum.name}") from None
        return time.monotonic() - sent


@pytest.fixture
def ignoring_pin(tmp_path: Path) -> Iterator[Callable[..., Started]]:
    """Starts `pin …` with SIGTERM and SIGINT ignored, in a session of its own; kills each one
    and everything it started, and reaps it, at the end, whatever the test did."""
    started: list[Started] = []

    def start(*args: str, env: dict[str, str]) -> Started:
        out, err = tmp_path / f"pin-{len(started)}.out", tmp_path / f"pin-{len(started)}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [PIN, *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=stdout,
                stderr=stderr,
                preexec_fn=ignore_stop_signals,
                start_new_session=True,
            )
        started.append(Started(process, out, err))
        return started[-1]

    try:
        yield start
    finally:
        for pin in started:
            kill_session(pin.process.pid)
            pin.process.wait()


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=SIGNAL_IDS)
def test_the_exporter_stops_promptly_even_when_started_with_the_signal_ignored(
    pg_dsn: str, ignoring_pin: Callable[..., Started], signum: signal.Signals
) -> None:
    """Tried: `pin metrics serve` started with SIGTERM and SIGINT ignored, serving; then one of
    them. It handles both itself, so it exits 0 within a few seconds and its port is closed."""
    port = free_port()
    exporter = ignoring_pin("metrics", "serve", "--port", str(port), env=pin_env(pg_dsn))
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: not exporter.alive() or answers_http(url), 30, "the exporter")
    assert exporter.alive(), exporter.stderr
    assert ignores(exporter.process.pid) == []  # its handlers replaced the inherited SIG_IGN

    took = exporter.stop(signum, timeout=5)
    assert exporter.process.returncode == 0, exporter.stderr
    assert took < 3, took
    assert not port_open("127.0.0.1", port)


def test_a_drain_stops_after_the_project_in_hand_even_when_started_with_sigterm_ignored(
    db: psycopg.Connection, pg_dsn: str, ignoring_pin: Callable[..., Started]
) -> None:
    """Tried: `pin recalc drain --once` over three due projects whose recalc sleeps 1 s each,
    started with SIGTERM and SIGINT ignored, gets SIGTERM inside the first project's recalc. It
    finishes that project and exits 0 with stopped_early; the other two stay queued."""
    for price in (100, 200, 300):
        project = make_project(db)
        layout = make_layout(db, project, None, 42)
        make_object(db, project, make_building(db, project), layout, status="Free", price=price)
    make_all_due(db)
    with slow_recalc(db, 1.0):
        drain = ignoring_pin("recalc", "drain", "--once", env=pin_env(pg_dsn))
        wait_for(lambda: sleeping_backends(db) == 1, 20, "the drain to be inside a recalc")
        took = drain.stop(signal.SIGTERM, timeout=10)
    assert drain.process.returncode == 0, drain.stderr
    summary = last_json_line(drain.stdout)
    assert (summary["stopped_early"], summary["processed"], summary["failed"]) == (True, 1, 0)
    assert took < 5, took
    assert len(queued_projects(db)) == 2


@pytest.fixture
def serve_env(db: psycopg.Connection, pg_dsn: str, tmp_path: Path) -> dict[str, str]:
    """`pin serve` on an instance of this test alone: its own Dagster storage database, state
    folder, port and embedded ClickHouse folder; Kafka points at a closed port, so the shipped
    sensors can never touch the shared broker's topics or consumer groups. The queue is empty
    (`db`), so no drain run starts either."""
    storage = f"{dbname(pg_dsn)}_dagster"
    with psycopg.connect(dsn_with_dbname(pg_dsn, "postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{storage}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{storage}"')
    return {
        **pin_env(pg_dsn),
        "PIN_STATE_DIR": str(tmp_path / "state"),
        "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
        "PIN_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "PIN_DAGSTER_PORT": str(free_port()),
        "PIN_DAGSTER_PG_URL": dagster_pg_url_from(pg_dsn, storage),
    }


@pytest.mark.parametrize("command", ["serve", "dev"])
def test_pin_serve_and_pin_dev_stop_with_their_dagster_processes_even_when_started_ignoring_them(
    serve_env: dict[str, str], ignoring_pin: Callable[..., Started], command: str
) -> None:
    """Tried: `pin serve` (and `pin dev`, which runs `dagster dev` the same way) started with
    SIGTERM and SIGINT ignored, the webserver answering, a run launched; then SIGTERM. `pin`
    installs its handlers before it starts the Dagster processes, so no inherited SIG_IGN
    survives: no process ignores either signal but Python's multiprocessing resource tracker,
    which the code server starts with its first run (Dagster runs each run in a `spawn`
    process) and which ignores both by design: it ends when the code server does. A CI run saw
    it as one process of `pin dev` ignoring both, when a schedule's run happened to start
    inside this test. `pin` exits 0 and nothing it started (run workers, the tracker, a code
    server its parent left behind) outlives it by more than a moment."""
    pin = ignoring_pin(command, env=serve_env)
    url = f"http://127.0.0.1:{serve_env['PIN_DAGSTER_PORT']}/server_info"
    wait_for(lambda: not pin.alive() or answers_http(url), 180, "the webserver")
    assert pin.alive(), pin.stderr
    client = DagsterGraphQLClient("127.0.0.1", port_number=int(serve_env["PIN_DAGSTER_PORT"]))
    wait_for(lambda: submit_run(client, "recalc_poison_check_job"), 120, "a run submitted")
    wait_for(lambda: resource_trackers(pin.process.pid) != [], 120, "the run's resource tracker")
    processes = session_pids(pin.process.pid)
    # pin, the webserver, the daemon, their code servers (and dagster dev), the run's processes
    assert len(processes) >= 4, session_processes(pin.process.pid)
    # The tracker ignores both once its main() has run (not yet, in its first moments); it ends
    # with the code server, which the session's end below checks.
    trackers = resource_trackers(pin.process.pid)
    others = [pid for pid in processes if pid not in trackers]
    assert {pid: ignores(pid) for pid in others} == {pid: [] for pid in others}

    pin.stop(signal.SIGTERM, timeout=60)
    assert pin.process.returncode == 0, pin.stderr
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not session_pids(pin.process.pid), 5, "the session to end")
    assert session_processes(pin.process.pid) == []


# --- the suite's own guards (tests/conftest.py), run on a small test file of their own ----------

GUARDED = """
import signal
import subprocess

import pytest


def test_ignores_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_leaves_a_process():
    subprocess.Popen(["sleep", "600"])


def test_waits_for_its_process():
    subprocess.run(["true"], check=True)


@pytest.fixture(scope="module")
def module_process():
    return subprocess.Popen(["sleep", "601"])  # never stopped


def test_with_a_module_process(module_process):
    pass
"""

ORPHANS = """
import subprocess

import pytest


def test_leaves_an_orphan():
    # A grandchild re-parented to init when its parent exits: the leaked code server's shape.
    subprocess.run(["sh", "-c", "sleep 602 >/dev/null 2>&1 &"], check=True)


def test_whose_orphan_ends_within_its_grace():
    subprocess.run(["sh", "-c", "sleep 1 >/dev/null 2>&1 &"], check=True)


@pytest.fixture(scope="module")
def detached_service(tmp_path_factory):
    # A private server of the run, in a session of its own as pg_ctl and `pin stack up` start
    # one, in the run's temporary folder; never stopped.
    folder = tmp_path_factory.mktemp("private-service")
    subprocess.run(["sh", "-c", "setsid sleep 603 >/dev/null 2>&1 &"], cwd=folder, check=True)


def test_with_a_detached_service(detached_service):
    pass


def test_while_the_fixture_holds_it(detached_service):
    # One of the shared stack, restarted by a test's `pin stack up`: it outlives the run.
    subprocess.run(
        ["sh", "-c", "setsid sleep 604 >/dev/null 2>&1 & echo $! > stack-service.pid"],
        cwd="{here}",
        check=True,
    )
"""

RULES = """
from pin_pipelines.stack.process import free_port
from tests.support import blackhole

PORT = free_port()


def test_leaves_a_rule_of_its_block():
    with blackhole.blackhole(PORT):
        # One more rule of this process, which the block does not know: a leftover.
        blackhole._iptables("-I", *blackhole._rule_specs(PORT, "to_port")[0])


def test_leaves_a_rule_outside_any_block():
    # Not looked for after this test (no block entered): at the end of the session.
    blackhole._iptables("-I", *blackhole._rule_specs(PORT, "from_port")[0])


def test_after_it():
    pass
"""

DAGSTER_THEN_A_CHILD = """
import subprocess

import dagster as dg


@dg.asset
def one() -> int:
    return 1


def test_dagster_in_process():
    assert dg.materialize([one]).success


def test_a_child_started_afterwards_can_be_terminated():
    child = subprocess.Popen(["sleep", "600"])
    try:
        status = open(f"/proc/{child.pid}/status").read()
        child.terminate()
        assert child.wait(timeout=5) == -15, status
    finally:
        child.kill()
        child.wait()
"""


def run_guarded(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess, with tests/conftest.py as its plugin, started with SIGINT and
    SIGQUIT ignored as CI started it."""
    test_file = tmp_path / "test_guarded.py"
    test_file.write_text(source)

    def as_ci() -> None:
        for signum in (signal.SIGINT, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_IGN)

    # No warnings summary: the plugins of tests/conftest.py import Dagster, whose deprecation
    # warnings the repository's pyproject.toml filters but this run's rootdir does not.
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings"]
    argv += ["-p", "tests.conftest"]
    return subprocess.run(
        [*argv, "--rootdir", str(tmp_path), str(test_file)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=as_ci,
        check=False,
    )


def test_the_suite_fails_a_test_that_changes_a_signal_or_leaves_a_process_and_kills_it(
    tmp_path: Path,
) -> None:
    """Tried, in a pytest of its own: a test that ignores SIGTERM, one that leaves `sleep 600`
    running, one that waits for its process, and one whose module fixture leaves `sleep 601`
    running. The first two fail by name, the third passes, the run fails at its end for the
    fourth, and both sleeps are killed."""
    result = run_guarded(tmp_path, GUARDED)
    output = result.stdout + result.stderr
    pids = {int(pid) for pid in re.findall(r"pid (\d+): sleep 60[01]", output)}
    try:
        assert result.returncode == 1, output
        assert "test_ignores_sigterm left signal dispositions changed (restored): SIGTERM" in (
            output
        )
        assert "test_leaves_a_process left processes alive (killed): pid " in output
        assert "processes left alive at the end of the session (killed): pid " in output
        assert "4 passed, 2 errors" in output, output
        assert len(pids) == 2, output
        assert not any(pid_alive(pid) for pid in pids)
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_suite_fails_a_test_that_leaves_an_orphaned_process_and_kills_it(
    tmp_path: Path,
) -> None:
    """Tried, in a pytest of its own: a test whose `sh -c "sleep 602 &"` leaves the sleep
    re-parented to init (a grandchild: the check of the children alone missed it, as it missed
    the code server of the issue), one whose orphan ends within the grace, a module fixture
    whose `setsid sleep 603` (a private service started detached, in the run's temporary
    folder) is held across two tests and never stopped, and a `setsid sleep 604` elsewhere (a
    service of the shared stack a test restarted). The first fails by name, the private service
    is not flagged while its fixture holds it and fails the run at its end, both are killed,
    and the stack's service is left alone."""
    result = run_guarded(tmp_path, ORPHANS.replace("{here}", str(tmp_path)))
    output = result.stdout + result.stderr
    pids = {int(pid) for pid in re.findall(r"pid (\d+): sleep 60[23]", output)}
    stack_service = int((tmp_path / "stack-service.pid").read_text())
    try:
        assert pid_alive(stack_service), output
        assert "sleep 604" not in output
        assert result.returncode == 1, output
        assert (
            "test_leaves_an_orphan left orphaned processes, re-parented outside the run "
            "(killed): pid "
        ) in output
        assert "orphaned processes of the run at the end of the session (killed): pid " in output
        assert "4 passed, 1 error" in output, output
        assert len(pids) == 2, output
        assert not any(pid_alive(pid) for pid in pids)
    finally:
        for pid in (*pids, stack_service):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_suite_deletes_a_leftover_rule_after_a_test_that_used_the_blackhole(
    tmp_path: Path,
) -> None:
    """Tried, in a pytest of its own: a test that leaves a rule of its process inside a
    `blackhole` block, one that inserts one outside any block, and one after. The first fails
    by name; the second is not looked at (only a test that entered a block pays for the two
    `iptables -S`), and its rule fails the run at its end. No rule of that pytest is left."""
    result = run_guarded(tmp_path, RULES)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "test_leaves_a_rule_of_its_block left iptables rules (deleted): -A INPUT" in output
    assert "iptables rules left at the end of the session (deleted): -A INPUT" in output
    assert "3 passed, 1 error" in output, output
    assert "test_leaves_a_rule_outside_any_block left" not in output
    assert remove_leftover_rules() == []


def test_dagster_in_process_no_longer_leaves_sigterm_ignored(tmp_path: Path) -> None:
    """The CI sequence: pytest started with SIGINT ignored, a Dagster asset materialized in
    process, then a test starts a child and terminates it. The child does not inherit SIGTERM
    ignored, and the Dagster test is not flagged as changing a disposition."""
    result = run_guarded(tmp_path, DAGSTER_THEN_A_CHILD)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout, result.stdout


def test_a_detached_service_stops_on_sigterm_even_when_its_starter_ignores_it(tmp_path):
    """Tried: a service started by `start_detached` (as `pin stack up` starts Kafka and
    PostgreSQL) from a process that ignores SIGTERM and SIGINT. The child gets both back at
    their defaults before exec, so `pin stack down`'s SIGTERM stops it at once instead of
    waiting out its grace period for a SIGKILL."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        pid = start_detached(
            ["sleep", "60"], pidfile=tmp_path / "sleep.pid", logfile=tmp_path / "sleep.log"
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        mask = next(ln for ln in status.splitlines() if ln.startswith("SigIgn:")).split()[1]
        assert not int(mask, 16) & (1 << (signal.SIGTERM - 1)), status
        os.kill(pid, signal.SIGTERM)
        _, code = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(code) and os.WTERMSIG(code) == signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
