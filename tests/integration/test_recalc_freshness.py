"""Spec 000's freshness as a user feels it, under `pin serve` (daemon, sensor, drain runs): a burst
of edits across many projects reaches the aggregates, and the due backlog is back to 0, within
the spec's bounds ("E2E-лаг событие → обновлённые счётчики/цены p99 < ~40 с (debounce 30 с +
обработка < 2 с + тик 5 с + запас)"; "due_backlog → 0 в пределах одного-двух тиков после
DueAt"), with a short debounce so the test takes seconds. The bounds are counted in the worker's
ticks from the database's own clock (the edit's transaction, the row's due_at, the recompute's
transaction), not timed by the test.

The Kafka broker is the session's private one: `pin serve` also starts its relay and load runs,
whose consumer group on the shared broker is every other `pin serve`'s on the machine."""

from __future__ import annotations

import signal
from datetime import datetime, timedelta
from pathlib import Path
from uuid import UUID

import psycopg
import pytest

from pin_pipelines.config import DEFAULT_RECALC_TICK_SECONDS
from pin_pipelines.stack.kafka import LocalKafka
from pin_pipelines.stack.process import wait_until
from tests.support.chessboard import make_building, make_object, make_project
from tests.support.recalc import queued_projects, set_settings
from tests.support.serve import kill_session, migrated_instance, start_serve
from tests.support.truth import drift

#: Alone on the machine: it holds the drain to the spec's bounds, counted from the database's
#: clock; the other workers' load on the CI machine's two cores would add their own launch and
#: scheduling delays to `pin serve`'s, and measure them instead.
pytestmark = pytest.mark.alone

#: The spec's worker tick (the recalc sensor's interval when PIN_RECALC_TICK_SECONDS is unset).
TICK = timedelta(seconds=DEFAULT_RECALC_TICK_SECONDS)
#: The spec's bound on the backlog: back to 0 within one or two ticks after DueAt.
TICKS_AFTER_DUE = 2
#: A short debounce (the spec's is 30 s): still longer than the sensor's tick, so that a drain
#: run is launched before the burst's rows fall due, as with the spec's.
DEBOUNCE = timedelta(seconds=10)
#: Projects edited in the burst: more than one batch (50) of a tick.
PROJECTS = 60
#: How long `pin serve` may take to start and drain the set-up's requests (its code location,
#: daemon and first run launch on a loaded machine).
START_SECONDS = 180


def _projects(conn: psycopg.Connection) -> list[UUID]:
    """PROJECTS projects with one free object each (a reprice moves the project's price bounds,
    so each recompute writes its project row)."""
    projects = []
    for _ in range(PROJECTS):
        project = make_project(conn)
        make_object(conn, project, make_building(conn, project), None, status="Free", price=100)
        projects.append(project)
    return projects


def _recomputed_at(conn: psycopg.Connection, projects: list[UUID]) -> dict[UUID, datetime]:
    """Each project row's updated_at: its last recompute transaction's now()."""
    rows = conn.execute(
        "SELECT id, updated_at FROM chessboard.projects WHERE id = ANY(%s)", (projects,)
    ).fetchall()
    return dict(rows)


def test_a_burst_of_edits_reaches_the_aggregates_within_two_ticks_of_its_due_time(
    db: psycopg.Connection, pg_dsn: str, dagster_db: str, kafka: LocalKafka, tmp_path: Path
) -> None:
    """Tried: `pin serve` with a 10 s debounce drains the set-up's requests; then one edit per
    project reprices a free object in each of 60 projects at once. Every edit's row falls due
    DEBOUNCE after it (the trailing debounce, a new row), and every project row is recomputed
    within two ticks of its row's due time (so within DEBOUNCE + two ticks of its edit: the
    spec's 40 s at its 30 s debounce); the queue is then empty, no row due, and every aggregate
    equals the source truth."""
    env = migrated_instance(
        pg_dsn=pg_dsn,
        dagster_db=dagster_db,
        kafka_bootstrap=kafka.settings.kafka_bootstrap,
        tmp_path=tmp_path,
    )
    set_settings(db, debounce=f"{DEBOUNCE.total_seconds():g} seconds")
    projects = _projects(db)

    serve = start_serve(env, tmp_path / "serve.log")
    try:
        wait_until(
            lambda: not queued_projects(db), timeout=START_SECONDS, what="the set-up drained"
        )
        for project in projects:
            db.execute(
                "UPDATE chessboard.property_objects SET price = price + 1 WHERE project_id = %s",
                (project,),
            )
        burst = queued_projects(db)
        assert set(burst) == set(projects)
        bound = DEBOUNCE + TICKS_AFTER_DUE * TICK
        # A deadline for the test only, well past the bound: the bound itself is checked below.
        wait_until(
            lambda: not queued_projects(db),
            timeout=3 * bound.total_seconds(),
            what="the burst drained",
        )
        recomputed = _recomputed_at(db, projects)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    finally:
        kill_session(serve.pid)
        serve.wait(timeout=30)

    for row in burst.values():
        assert row["due_at"] == row["first_requested_at"] + DEBOUNCE, row
    after_due = {project: recomputed[project] - row["due_at"] for project, row in burst.items()}
    after_edit = {
        project: recomputed[project] - row["first_requested_at"] for project, row in burst.items()
    }
    late = {p: lag for p, lag in after_due.items() if lag > TICKS_AFTER_DUE * TICK}
    assert not late, f"recomputed more than {TICKS_AFTER_DUE} ticks after due: {late}"
    assert max(after_edit.values()) <= bound
    assert min(after_due.values()) >= timedelta(0)  # never before the debounce ended
    assert drift(db) == {}
