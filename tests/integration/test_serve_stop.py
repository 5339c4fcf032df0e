"""A clean stop of `pin serve` (issue 15): SIGTERM while a drain run is in flight ends with that
run succeeded and no run in FAILURE, on a real daemon, webserver and PostgreSQL-backed instance."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import dagster as dg
import psycopg
import pytest
from dagster_shared.error import SerializableErrorInfo

from pin_pipelines.config import dagster_pg_url_from
from pin_pipelines.defs.common import STOPPING_MARKER
from pin_pipelines.serve import WIND_DOWN_SECONDS
from pin_pipelines.stack.process import free_port, wait_until
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.recalc import PIN, REPO_ROOT, sleeping_backends, slow_recalc


def test_sigterm_waits_for_the_drain_in_flight_and_leaves_no_failed_run(
    db: psycopg.Connection,
    pg_dsn: str,
    dagster_db: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: `pin serve` on its own instance; three due projects whose recalc takes 1.5 s each
    (a test trigger), so the sensor's drain run is in the middle of them when `pin serve` gets
    SIGTERM. Before issue 15 the daemon and the code server were stopped at once: the drain was
    cut off, and a run launched meanwhile failed ("Tried to start a run on a server after telling
    it to shut down"). Now the sensors stop launching, the drain ends after the project in hand,
    `pin serve` waits for it and exits 0, and no run of the instance is in FAILURE."""
    home = tmp_path / "dagster_home"
    storage_url = dagster_pg_url_from(dagster_db, dagster_db.rsplit("/", 1)[1])
    env = {
        **os.environ,
        "PIN_PG_DSN": pg_dsn,
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
    db.execute("UPDATE chessboard.project_recalc_requests SET due_at = now()")

    log = tmp_path / "serve.log"
    with slow_recalc(db, 1.5):
        serve = subprocess.Popen(
            [PIN, "serve"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            start_new_session=True,  # its daemon and webserver are killed with it on failure
        )
        try:
            monkeypatch.setenv("PIN_DAGSTER_PG_URL", storage_url)  # for this test's instance
            wait_until(
                lambda: (home / "dagster.yaml").exists(),
                timeout=30,
                what="the instance's dagster.yaml",
            )
            with dg.DagsterInstance.from_config(str(home)) as instance:

                def drain_started() -> bool:
                    return bool(
                        instance.get_run_records(
                            dg.RunsFilter(
                                job_name="recalc_drain_job",
                                statuses=[dg.DagsterRunStatus.STARTED],
                            )
                        )
                    )

                wait_until(drain_started, timeout=90, what="a drain run in flight")
                wait_until(
                    lambda: sleeping_backends(db) == 1,
                    timeout=30,
                    what="the drain inside a project",
                )
                serve.send_signal(signal.SIGTERM)
                try:
                    serve.wait(timeout=WIND_DOWN_SECONDS + 45)
                finally:
                    stderr = log.read_text()
                assert serve.returncode == 0, stderr[-3000:]
                assert "waiting for the runs in flight" in stderr
                runs = {
                    r.dagster_run.run_id: (r.dagster_run.job_name, r.dagster_run.status)
                    for r in instance.get_run_records()
                }
                failures = [
                    (e.message, _error_messages(e.dagster_event.step_failure_data.error))
                    for run_id, (_, status) in runs.items()
                    if status != dg.DagsterRunStatus.SUCCESS
                    for e in instance.all_logs(run_id)
                    if e.dagster_event and e.dagster_event.is_step_failure
                ]
        finally:
            if serve.poll() is None:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(timeout=30)
    assert ("recalc_drain_job", dg.DagsterRunStatus.SUCCESS) in runs.values()
    assert [r for r in runs.values() if r[1] != dg.DagsterRunStatus.SUCCESS] == [], failures
    assert not (home / STOPPING_MARKER).exists()


def _error_messages(error: SerializableErrorInfo | None) -> list[str]:
    """What a step failure says, cause by cause, without the stacks (a stack's tail hid the
    Kafka error of a CI failure)."""
    messages = []
    while error is not None:
        messages.append(error.message.strip())
        error = error.cause
    return messages
