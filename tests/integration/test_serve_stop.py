"""A clean stop of `pin serve`: SIGTERM while a drain run, the long-lived relay run
and the long-lived load run (5 minutes each) are in flight ends with those runs
succeeded, no new run launched and no run in FAILURE, on a real daemon, webserver and
PostgreSQL-backed instance.

The Kafka broker is the session's private one (tests/support/private_kafka.py): the load run
joins the loader's consumer group, which on the shared broker is the group of every other `pin
serve` on the machine (benchmarks, other sessions), and would take partitions from their
loaders."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime, timedelta
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pin_pipelines.defs.stopping import STOPPING_MARKER
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.devstats import shares
from tests.support.recalc import sleeping_backends, slow_recalc
from tests.support.serve import (
    failure_messages,
    kill_session,
    migrated_instance,
    session_processes,
    start_serve,
)

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


#: How an operator's tools stop `pin serve`: Ctrl-C in the terminal of `bin/up` (SIGINT
#: to the whole foreground process group), `kill -TERM -<pgid>` (SIGTERM to that group), and a
#: SIGTERM to its pid followed by SIGKILL to everything left after a 30 s grace: Kubernetes' stop,
#: and a plain `kill <pid>` or systemd's with KillMode=mixed up to their SIGKILL.
STOPS = {
    "ctrl-c": (signal.SIGINT, "group"),
    "kill-group": (signal.SIGTERM, "group"),
    "kubernetes": (signal.SIGTERM, "pid-then-sigkill-at-30s"),
}
#: Nothing of the instance may be alive this long after the stop signal (Kubernetes' default
#: grace period: what is left then is SIGKILLed mid-batch).
GRACE_SECONDS = 30.0


@pytest.mark.parametrize("stop", list(STOPS))
def test_sigterm_waits_for_the_runs_in_flight_and_leaves_no_failed_run(
    stop: str,
    db: psycopg.Connection,
    pg_dsn: str,
    dagster_db: str,
    kafka: LocalKafka,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: `pin serve` on its own instance and broker. Once its relay run is in its loop (its
    named PostgreSQL session) and its load run holds the topic's partitions in the loader's
    group, three projects become due whose recalc takes 4 s each (a test trigger), and
    `pin serve` gets SIGTERM while the drain run is inside the first. A stop that ends the daemon
    and the code server at once cuts the drain off, and a run launched meanwhile fails ("Tried to
    start a run on a server after telling it to shut down"). Now the sensors launch nothing more,
    the drain ends after the project in hand, the relay and the load after their batch in hand (the
    load with its one materialization), `pin serve` waits for the three, well within its bound, and
    exits 0; no run of the instance is in FAILURE.

    Each way an operator's tools stop it is tried (STOPS), not only the signal to its pid: a
    stop handled for the pid alone lets the signal sent to the whole process group (Ctrl-C)
    reach the run workers themselves, which store their batch in hand and then fail ("Execution
    was interrupted unexpectedly"; 4 of 4 times), and a code server once outlived the stop by
    minutes. Now every run ends SUCCESS and nothing of the instance is alive 30 s after the signal
    (the Kubernetes stop's SIGKILL then finds nothing to kill)."""
    signum, target = STOPS[stop]
    bootstrap = kafka.settings.kafka_bootstrap
    env = migrated_instance(
        pg_dsn=pg_dsn, dagster_db=dagster_db, kafka_bootstrap=bootstrap, tmp_path=tmp_path
    )
    home = Path(env["DAGSTER_HOME"])
    for _ in range(3):
        project = make_project(db)
        make_object(db, project, make_building(db, project), None, status="Free", price=5)
    # Queued, not due: the drain starts once the relay and the load are in flight.
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now() + interval '1 hour'")

    log = tmp_path / "serve.log"
    with slow_recalc(db, PROJECT_SECONDS):
        serve = start_serve(env, log)
        try:
            # For this test's instance.
            monkeypatch.setenv("PIN_DAGSTER_PG_URL", env["PIN_DAGSTER_PG_URL"])
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
                if target == "group":
                    os.killpg(serve.pid, signum)
                else:
                    serve.send_signal(signum)
                begun = time.monotonic()
                try:
                    serve.wait(timeout=GRACE_SECONDS)
                except subprocess.TimeoutExpired:
                    if target != "pid-then-sigkill-at-30s":
                        raise
                finally:
                    stderr = log.read_text()
                took = time.monotonic() - begun
                while session_processes(serve.pid) and time.monotonic() - begun < GRACE_SECONDS:
                    time.sleep(0.2)
                left = session_processes(serve.pid)
                if target == "pid-then-sigkill-at-30s":
                    kill_session(serve.pid)
                    serve.wait(timeout=30)
                assert serve.returncode == 0, stderr[-3000:]
                assert "waiting for the runs in flight" in stderr
                assert "canceling them" not in stderr
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
                    (run.job_name, e.message, failure_messages(e.dagster_event))
                    for run_id, run in runs.items()
                    if run.status != dg.DagsterRunStatus.SUCCESS
                    for e in instance.all_logs(run_id)
                    if e.dagster_event
                    and (e.dagster_event.is_step_failure or e.dagster_event.is_failure)
                ]
        finally:
            # Its daemon, webserver, code servers and run workers, also any a failed stop left
            # behind after `pin serve` itself exited: they share its session.
            kill_session(serve.pid)
            serve.wait(timeout=30)
    assert left == [], f"alive {GRACE_SECONDS:g}s after the stop signal"
    assert all(len(ids) == 1 for ids in in_flight.values()), in_flight
    assert {job: [runs[i].status for i in ids] for job, ids in in_flight.items()} == {
        job: [dg.DagsterRunStatus.SUCCESS] for job in in_flight
    }
    # A run still queued at the stop is canceled by it: it never started (the sensors and the
    # schedules ask for it again after the next start).
    never_started = {r.dagster_run.run_id for r in records if r.start_time is None}
    assert [
        (run.job_name, run.status)
        for run_id, run in runs.items()
        if run.status != dg.DagsterRunStatus.SUCCESS
        and not (run.status == dg.DagsterRunStatus.CANCELED and run_id in never_started)
    ] == [], failures
    assert late == [], "a run launched after the stop"
    # The stop ends each run after its batch or project in hand: seconds, within the grace.
    assert took < GRACE_SECONDS, stderr[-3000:]
    assert list(load_events.values()) == [["ASSET_MATERIALIZATION"]], load_events
    assert not (home / STOPPING_MARKER).exists()
