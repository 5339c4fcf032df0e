"""A clean stop of `pin serve` (issue 15): SIGTERM while a drain run, the long-lived relay run
and the long-lived load run (issue 19: 5 minutes each) are in flight ends with those runs
succeeded, no new run launched and no run in FAILURE, on a real daemon, webserver and
PostgreSQL-backed instance.

The Kafka broker is this module's own (test_relay_exactly_once's fixture): the load run joins the
loader's consumer group, which on the shared broker is the group of every other `pin serve` on
the machine (benchmarks, other sessions), and would take partitions from their loaders."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from datetime import datetime, timedelta
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from dagster_shared.error import SerializableErrorInfo

from pin_pipelines.config import dagster_pg_url_from
from pin_pipelines.defs.common import STOPPING_MARKER
from pin_pipelines.serve import WIND_DOWN_SECONDS
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import free_port, wait_until
from tests.integration.test_kafka_cluster import shares
from tests.integration.test_relay_exactly_once import kafka  # noqa: F401 (the module's broker)
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.recalc import PIN, REPO_ROOT, sleeping_backends, slow_recalc

#: How long the drain's recalc of one project takes (a test trigger): longer than `pin serve`
#: takes to stop its daemon when it does not wait, so a stop that left the drain behind fails.
PROJECT_SECONDS = 4.0
#: A sensor tick evaluated just before the stop may still turn into a run this long after it.
TICK_IN_FLIGHT = timedelta(seconds=10)


def relay_sessions(conn: psycopg.Connection) -> int:
    """Sessions of a relay in its loop (the relay names its connection, docs/runbook.md §5)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = 'pin-outbox-relay' AND datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def test_sigterm_waits_for_the_runs_in_flight_and_leaves_no_failed_run(
    db: psycopg.Connection,
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: `pin serve` on its own instance and broker. Once its relay run is in its loop (its
    named PostgreSQL session) and its load run holds the topic's partitions in the loader's
    group, three projects become due whose recalc takes 4 s each (a test trigger), and
    `pin serve` gets SIGTERM while the drain run is inside the first. Before issue 15 the
    daemon and the code server were stopped at once: the drain was cut off, and a run launched
    meanwhile failed ("Tried to start a run on a server after telling it to shut down"). Now
    the sensors launch nothing more, the drain ends after the project in hand, the relay and
    the load after their batch in hand (the load with its one materialization), `pin serve`
    waits for the three, well within its bound, and exits 0; no run of the instance is in
    FAILURE."""
    home = tmp_path / "dagster_home"
    storage_url = dagster_pg_url_from(dagster_db, dagster_db.rsplit("/", 1)[1])
    bootstrap = kafka.settings.kafka_bootstrap
    env = {
        **os.environ,
        "PIN_PG_DSN": pg_dsn,
        "PIN_KAFKA_BOOTSTRAP": bootstrap,
        "DAGSTER_HOME": str(home),
        "PIN_DAGSTER_PG_URL": storage_url,
        "PIN_DAGSTER_PORT": str(free_port()),
        "PIN_CLICKHOUSE_URL": f"chdb://{tmp_path / 'chdb'}",
    }
    # Its own embedded dimension, migrated by `pin db migrate` (chdb: one process per folder).
    subprocess.run([PIN, "db", "migrate"], cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    for _ in range(3):
        project = make_project(db)
        make_object(db, project, make_building(db, project), None, status="Free", price=5)
    # Queued, not due: the drain starts once the relay and the load are in flight.
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() + interval '1 hour'")

    log = tmp_path / "serve.log"
    with slow_recalc(db, PROJECT_SECONDS):
        serve = subprocess.Popen(
            [PIN, "serve"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            start_new_session=True,  # one session: the finally below kills what is left of it
        )
        try:
            monkeypatch.setenv("PIN_DAGSTER_PG_URL", storage_url)  # for this test's instance
            wait_until(
                lambda: (home / "dagster.yaml").exists(),
                timeout=30,
                what="the instance's dagster.yaml",
            )
            with dg.DagsterInstance.from_config(str(home)) as instance:

                def started(job: str) -> list[str]:
                    return [
                        r.dagster_run.run_id
                        for r in instance.get_run_records(
                            dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.STARTED])
                        )
                    ]

                wait_until(lambda: relay_sessions(db) == 1, timeout=120, what="a relay run")
                wait_until(lambda: any(shares(bootstrap)), timeout=120, what="a load run")
                in_flight = {
                    job: started(job) for job in ("outbox_relay_job", "dim_layout_group_job")
                }
                db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")
                wait_until(
                    lambda: bool(started("recalc_drain_job")), timeout=90, what="a drain run"
                )
                wait_until(
                    lambda: sleeping_backends(db) == 1,
                    timeout=30,
                    what="the drain inside a project",
                )
                in_flight["recalc_drain_job"] = started("recalc_drain_job")
                stopped_at = datetime.now().astimezone()
                serve.send_signal(signal.SIGTERM)
                begun = time.monotonic()
                try:
                    serve.wait(timeout=WIND_DOWN_SECONDS + 45)
                finally:
                    stderr = log.read_text()
                took = time.monotonic() - begun
                assert serve.returncode == 0, stderr[-3000:]
                assert "waiting for the runs in flight" in stderr
                assert "stopping anyway" not in stderr
                records = instance.get_run_records()
                runs = {r.dagster_run.run_id: r.dagster_run for r in records}
                late = [
                    (r.dagster_run.job_name, r.create_timestamp)
                    for r in records
                    if r.create_timestamp > stopped_at + TICK_IN_FLIGHT
                ]
                load_events = {
                    run_id: [
                        e.dagster_event.event_type_value
                        for e in instance.all_logs(run_id)
                        if e.dagster_event and e.dagster_event.is_step_materialization
                    ]
                    for run_id in in_flight["dim_layout_group_job"]
                }
                failures = [
                    (e.message, _error_messages(e.dagster_event.step_failure_data.error))
                    for run_id, run in runs.items()
                    if run.status != dg.DagsterRunStatus.SUCCESS
                    for e in instance.all_logs(run_id)
                    if e.dagster_event and e.dagster_event.is_step_failure
                ]
        finally:
            # Its daemon, webserver, code servers and run workers, also any a failed stop left
            # behind after `pin serve` itself exited: they share its session.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=30)
    assert all(len(ids) == 1 for ids in in_flight.values()), in_flight
    assert {job: [runs[i].status for i in ids] for job, ids in in_flight.items()} == {
        job: [dg.DagsterRunStatus.SUCCESS] for job in in_flight
    }
    assert [
        (run.job_name, run.status)
        for run in runs.values()
        if run.status != dg.DagsterRunStatus.SUCCESS
    ] == [], failures
    assert late == [], "a run launched after the stop"
    # The stop ends each run after its batch or project in hand: seconds, not the 60 s bound.
    assert took < WIND_DOWN_SECONDS / 2, stderr[-3000:]
    assert list(load_events.values()) == [["ASSET_MATERIALIZATION"]], load_events
    assert not (home / STOPPING_MARKER).exists()


def _error_messages(error: SerializableErrorInfo | None) -> list[str]:
    """What a step failure says, cause by cause, without the stacks (a stack's tail hid the
    Kafka error of a CI failure)."""
    messages = []
    while error is not None:
        messages.append(error.message.strip())
        error = error.cause
    return messages
