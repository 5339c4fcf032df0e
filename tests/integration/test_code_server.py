"""`pin serve`'s one code server: at rest nothing is started under it (the long runs' hand-overs
excepted), the daemon and the webserver share that one code server, and a killed code server is
replaced and runs launch again (issue 48).

The Kafka broker is the session's private one (tests/support/private_kafka.py): the load run
joins the loader's consumer group, which on the shared broker other `pin serve`s use.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from dagster._core.storage.tags import GRPC_INFO_TAG, SCHEDULE_NAME_TAG
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError

from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.chessboard import make_all_due, make_building, make_object, make_project
from tests.support.recalc import PIN, REPO_ROOT
from tests.support.serve import (
    code_servers,
    instance_env,
    kill_session,
    session_table,
    start_serve,
)

#: The long-lived runs the sensors keep going; their hand-overs start a run worker each.
LONG_RUN_JOBS = ("outbox_relay_job", "dim_layout_group_job")
#: After both long runs started: the start's own work (first ticks, the first loads) is over.
SETTLE_SECONDS = 60.0
#: The window at rest, as issue 48 asks it.
REST_SECONDS = 90.0
#: A run launched by the end of the window has reported its worker's pid within this long.
PID_REPORTED_SECONDS = 60.0
#: A short job, submitted through the webserver.
JOB = "recalc_poison_check_job"
#: The bound on each recovery after the code server's kill (the daemon refreshes its workspace
#: every 60 s at the latest; the rest is launching and running a short run on a loaded machine).
RECOVERY_SECONDS = 180.0
#: Whatever `pin serve` started is gone this long after it exited (its sweeper included).
GONE_SECONDS = 15.0
LOCATION_PORT = """
{ workspaceOrError { ... on Workspace { locationEntries { name
    displayMetadata { key value } locationOrLoadError { __typename } } } } }"""


@contextmanager
def pin_serve(
    env: dict[str, str], home: Path, log: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[subprocess.Popen[bytes], dg.DagsterInstance, DagsterGraphQLClient]]:
    """`pin serve` on the test's instance, with that instance and a client of its webserver;
    everything of its session is killed at the end."""
    subprocess.run([PIN, "db", "migrate"], cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    monkeypatch.setenv("PIN_DAGSTER_PG_URL", env["PIN_DAGSTER_PG_URL"])
    serve = start_serve(env, log)
    try:
        wait_until(lambda: (home / "dagster.yaml").exists(), timeout=30, what="dagster.yaml")
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield (
                serve,
                instance,
                DagsterGraphQLClient("127.0.0.1", port_number=int(env["PIN_DAGSTER_PORT"])),
            )
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)


def runs(
    instance: dg.DagsterInstance, job: str, *statuses: dg.DagsterRunStatus
) -> list[dg.RunRecord]:
    return list(
        instance.get_run_records(dg.RunsFilter(job_name=job, statuses=list(statuses) or None))
    )


def run_worker_pids(instance: dg.DagsterInstance, record: dg.RunRecord) -> set[int]:
    """The run worker's pid, from the run's "Started process for run (pid: …)" engine event
    (Dagster writes the pid as text: read as an int, none was ever found, and a CI run failed
    on a hand-over's worker)."""
    pids = set()
    for entry in instance.all_logs(
        record.dagster_run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT
    ):
        data = entry.dagster_event.engine_event_data if entry.dagster_event else None
        pid = data.metadata.get("pid") if data else None
        if pid is not None and str(pid.value).isdigit():
            pids.add(int(str(pid.value)))
    return pids


def run_workers(instance: dg.DagsterInstance) -> dict[int, dg.DagsterRun]:
    """The run of each run worker the instance's runs reported (by its pid engine event), once
    every run launched by now has reported its worker: a run launched in the window's last
    seconds has a worker before it has reported it."""

    def unreported() -> list[str]:
        launching = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTING])
        return [
            record.dagster_run.run_id
            for record in instance.get_run_records(launching)
            if not run_worker_pids(instance, record)
        ]

    wait_until(lambda: not unreported(), timeout=PID_REPORTED_SECONDS, what="the runs' pids")
    return {
        pid: record.dagster_run
        for record in instance.get_run_records()
        for pid in run_worker_pids(instance, record)
    }


def at_rest_anyway(run: dg.DagsterRun) -> bool:
    """A run that may start a process at rest: a long run's hand-over, and a schedule's run
    (the check schedules start a run worker every 5 minutes: not at rest, and the lean
    defaults' part of issue 48, not the code server's)."""
    return run.job_name in LONG_RUN_JOBS or SCHEDULE_NAME_TAG in run.tags


def finished(instance: dg.DagsterInstance, run_id: str) -> bool:
    run = instance.get_run_by_id(run_id)
    return run is not None and run.is_finished


def run_through_webserver(
    client: DagsterGraphQLClient, instance: dg.DagsterInstance, log: Path, timeout: float
) -> None:
    """Submit JOB through the webserver until one such run succeeds (a submission is refused
    while its location is unreachable; a run fails when its launch finds no code server)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            run_id = client.submit_job_execution(JOB)
        except DagsterGraphQLClientError:
            run_id = None
        if run_id:
            wait_until(
                partial(finished, instance, run_id),
                timeout=max(1.0, deadline - time.monotonic()),
                what=f"the {JOB} run {run_id}",
                logfile=log,
            )
            run = instance.get_run_by_id(run_id)
            if run and run.status == dg.DagsterRunStatus.SUCCESS:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"no {JOB} run succeeded within {timeout:g}s")
        time.sleep(1)


def test_at_rest_nothing_is_started_and_the_daemon_and_the_webserver_share_one_code_server(
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried on the code before the change: `pin serve` at rest, its relay and load runs in
    their loops, for 90 s after a settle minute, its session sampled from /proc every 0.2 s.
    ... (see the report)
    Now: no process is started in the window but the run workers of a long run's hand-over
    or of a schedule's run (identified by their run's pid engine event; a schedule's run is not
    at rest), one `dagster api grpc` runs, a child of `pin serve`, and both the daemon (the runs
    it launched went to that server's port) and the webserver (its location is that port) use
    it. PIN_LONG_RUN_SECONDS stays at its default."""
    env = instance_env(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka.settings.kafka_bootstrap,
        tmp_path=tmp_path,
    )
    home = Path(env["DAGSTER_HOME"])
    log = tmp_path / "serve.log"
    with pin_serve(env, home, log, monkeypatch) as (serve, instance, client):
        wait_until(
            lambda: all(runs(instance, job, dg.DagsterRunStatus.STARTED) for job in LONG_RUN_JOBS),
            timeout=180,
            what="the relay and load runs",
            logfile=log,
        )
        time.sleep(SETTLE_SECONDS)
        before = session_table(serve.pid)
        seen = dict(before)
        servers: set[int] = set(code_servers(serve.pid))
        end = time.monotonic() + REST_SECONDS
        while time.monotonic() < end:
            now = session_table(serve.pid)
            seen.update({pid: row for pid, row in now.items() if pid not in seen})
            servers |= {pid for pid, (_, command) in now.items() if " api grpc " in command}
            time.sleep(0.2)
        workers = run_workers(instance)
        started = {pid: row for pid, row in seen.items() if pid not in before}

        def run_of(pid: int) -> dg.DagsterRun | None:
            """The run whose worker is `pid` or one of its ancestors."""
            while pid in seen:
                if pid in workers:
                    return workers[pid]
                pid = seen[pid][0]
            return None

        unexplained = {
            pid: (command[:120], run.job_name if run else None)
            for pid, (_, command) in started.items()
            if not ((run := run_of(pid)) and at_rest_anyway(run))
        }
        port = {
            json.loads(record.dagster_run.tags[GRPC_INFO_TAG]).get("port")
            for job in LONG_RUN_JOBS
            for record in runs(instance, job)
        }
        entries = client._execute(LOCATION_PORT)["workspaceOrError"]["locationEntries"]
    assert unexplained == {}, f"started at rest: {unexplained}"
    assert len(servers) == 1, f"code servers: {[seen[p][1][:160] for p in servers]}"
    (server,) = servers
    assert seen[server][0] == serve.pid, "the code server is not `pin serve`'s own child"
    argv = seen[server][1].split()
    server_port = argv[argv.index("-p") + 1]
    assert port == {int(server_port)}, f"the daemon launched runs on {port}"
    (entry,) = entries
    metadata = {item["key"]: item["value"] for item in entry["displayMetadata"]}
    assert metadata.get("port") == server_port, metadata
    assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation", entry


def test_a_killed_code_server_is_replaced_and_runs_launch_again(
    db: psycopg.Connection,
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: `pin serve` on its own instance, a run submitted through the webserver succeeded;
    then SIGKILL to its code server(s), and a project made due. ...
    Now the code server is started again, the drain sensor launches the project's drain run,
    and a run submitted through the webserver after the kill succeeds, within the bound (the
    seconds each took are printed)."""
    env = instance_env(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka.settings.kafka_bootstrap,
        tmp_path=tmp_path,
    )
    home = Path(env["DAGSTER_HOME"])
    log = tmp_path / "serve.log"
    with pin_serve(env, home, log, monkeypatch) as (serve, instance, client):
        run_through_webserver(client, instance, log, timeout=240)
        killed = code_servers(serve.pid)
        assert killed, "no code server"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        project = make_project(db)
        make_object(db, project, make_building(db, project), None, status="Free", price=5)
        make_all_due(db)
        since = datetime.now(UTC)
        wait_until(
            lambda: bool(set(code_servers(serve.pid)) - set(killed)),
            timeout=60,
            what="a code server started again",
            logfile=log,
        )
        replaced = time.monotonic() - killed_at
        run_through_webserver(client, instance, log, timeout=RECOVERY_SECONDS)
        submitted = time.monotonic() - killed_at
        wait_until(
            lambda: any(
                r.create_timestamp > since
                for r in runs(instance, "recalc_drain_job", dg.DagsterRunStatus.SUCCESS)
            ),
            timeout=RECOVERY_SECONDS,
            what="a drain run launched by the sensor after the kill",
            logfile=log,
        )
        drained = time.monotonic() - killed_at
    print(
        f"\ncode server killed: another started after {replaced:.1f}s; a {JOB} run submitted "
        f"through the webserver succeeded {submitted:.1f}s after the kill; the drain sensor's "
        f"run {drained:.1f}s after it",
        file=sys.stderr,
    )


def test_a_code_server_port_in_use_fails_the_start_in_one_line(
    pg_dsn: str, dagster_db: str, tmp_path: Path
) -> None:
    """Tried: PIN_CODE_SERVER_PORT naming a port another process listens on. The code server
    cannot bind it and exits; `pin serve` then ends at once, non-zero, with one line that says
    so and names the port, and leaves nothing running (on the code before the change the
    setting did not exist: `pin serve` started as usual and had not ended after the bound)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = instance_env(
            pg_dsn=pg_dsn,
            dagster_db=dagster_db,
            kafka_bootstrap="127.0.0.1:1",  # never reached: nothing starts
            tmp_path=tmp_path,
            PIN_CODE_SERVER_PORT=str(port),
        )
        log = tmp_path / "serve.log"
        serve = start_serve(env, log)
        try:
            code = serve.wait(timeout=RECOVERY_SECONDS)
            ended = time.monotonic()
            while session_table(serve.pid) and time.monotonic() - ended < GONE_SECONDS:
                time.sleep(0.2)
            left = session_table(serve.pid)
        finally:
            kill_session(serve.pid)
            serve.wait(timeout=30)
    lines = log.read_text().strip().splitlines()
    assert code != 0
    assert re.fullmatch(
        rf"pin: error: the code server exited with code -?\d+ while starting on "
        rf"127\.0\.0\.1:{port} \(its log above\)",
        lines[-1],
    ), lines[-5:]
    assert left == {}


def test_a_code_server_that_keeps_dying_stops_pin_serve_in_one_line(
    pg_dsn: str, dagster_db: str, tmp_path: Path
) -> None:
    """Tried: once `pin serve` is up, its code server SIGKILLed as soon as it appears, again and
    again (a server that cannot run there). `pin serve` starts it again twice, then ends,
    non-zero, with one line that says so, and leaves nothing running; it does not loop (on the
    code before the change nothing of `pin serve` restarted code servers, and it had not ended
    after the bound)."""
    env = instance_env(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap="127.0.0.1:1",  # the sensors' runs may fail: only the code server counts
        tmp_path=tmp_path,
    )
    log = tmp_path / "serve.log"
    serve = start_serve(env, log)
    killed: set[int] = set()
    try:
        wait_until(lambda: "pin: Dagster UI on" in log.read_text(), timeout=180, what="pin serve")
        deadline = time.monotonic() + RECOVERY_SECONDS
        while serve.poll() is None and time.monotonic() < deadline:
            for pid in set(code_servers(serve.pid)) - killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.1)
        code = serve.wait(timeout=1)
        ended = time.monotonic()
        while session_table(serve.pid) and time.monotonic() - ended < GONE_SECONDS:
            time.sleep(0.2)
        left = session_table(serve.pid)
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)
    lines = log.read_text().strip().splitlines()
    assert code != 0
    assert lines[-1] == (
        "pin: error: the code server exited 3 times in a row within 60s of its start (last "
        "with code -9)"
    ), lines[-5:]
    assert len(killed) == 3
    assert left == {}
