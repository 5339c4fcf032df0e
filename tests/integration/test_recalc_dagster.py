"""Spec 000 in Dagster against the real database: the 5-second queue sensor, the drain job run
in process, the runbook jobs (force-recalc, poison requeue) and the poison asset check."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import UUID

import dagster as dg
import psycopg
import pytest

from pin_pipelines.definitions import defs
from pin_pipelines.defs.recalc.jobs import (
    force_recalc_job,
    recalc_drain_job,
    requeue_poisoned_job,
)
from pin_pipelines.defs.recalc.sensors import recalc_queue_sensor
from pin_pipelines.defs.resources import CHESSBOARD_AGGREGATES, RESOURCES
from tests.support.chessboard import (
    make_building,
    make_layout,
    make_layout_group,
    make_object,
    make_project,
)
from tests.support.pg_cost import database_cost
from tests.support.recalc import (
    clear_queue,
    failing_recalc,
    queue_row,
    queued_projects,
)
from tests.support.truth import drift


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture(autouse=True)
def _default_max_drain_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIN_RECALC_MAX_DRAIN_RUNS", raising=False)


def _populated_project(conn: psycopg.Connection) -> UUID:
    project = make_project(conn)
    building = make_building(conn, project)
    layout = make_layout(conn, project, make_layout_group(conn, project), 50)
    make_object(conn, project, building, layout, status="Free", price=1000)
    make_object(conn, project, building, layout, status="Sold", price=2000)
    return project


def _set_due(conn: psycopg.Connection, project: UUID, seconds_from_now: float) -> None:
    conn.execute(
        "UPDATE chessboard.project_recalc_requests SET due_at = now() + make_interval(secs => %s)"
        " WHERE project_id = %s",
        (seconds_from_now, project),
    )


def _poison(conn: psycopg.Connection, project: UUID, error: str) -> None:
    conn.execute(
        "UPDATE chessboard.project_recalc_requests SET attempt_count = 5, last_error = %s,"
        " due_at = now() - interval '1 minute' WHERE project_id = %s",
        (error, project),
    )


def _evaluate(instance: dg.DagsterInstance) -> dg.RunRequest | dg.SkipReason:
    result = recalc_queue_sensor(dg.build_sensor_context(instance=instance, resources=RESOURCES))
    assert isinstance(result, dg.RunRequest | dg.SkipReason), result
    return result


def _in_flight(instance: dg.DagsterInstance, *statuses: dg.DagsterRunStatus) -> None:
    for status in statuses:
        instance.create_run_for_job(job_def=recalc_drain_job, status=status)


def _drain_config(budget: float = 2.0) -> dict:
    return {"ops": {"drain_recalc_queue": {"config": {"budget_seconds": budget}}}}


def _metadata(event) -> dict:
    return {key: getattr(value, "value", value) for key, value in event.metadata.items()}


# --- sensor ---------------------------------------------------------------------------------


def test_sensor_skips_an_empty_queue_and_a_poison_only_queue(db, instance):
    """The sensor on an empty queue, then on a queue holding only a poisoned row: SkipReason
    both times (poison is left for triage and must not launch runs every 5 s). Each evaluation
    still beats: the scheduler's liveness shows whatever the queue holds."""
    db.execute("DELETE FROM chessboard.recalc_scheduler_beats")
    assert isinstance(_evaluate(instance), dg.SkipReason)
    beat = db.execute(
        "SELECT scheduler, beats, now() - last_beat_at < interval '5 seconds'"
        " FROM chessboard.recalc_scheduler_beats"
    ).fetchall()
    assert beat == [("recalc_queue_sensor", 1, True)]
    project = _populated_project(db)
    _poison(db, project, "bad")
    result = _evaluate(instance)
    assert isinstance(result, dg.SkipReason)
    assert "empty" in (result.skip_message or "")
    assert db.execute("SELECT beats FROM chessboard.recalc_scheduler_beats").fetchall() == [(2,)]


def test_sensor_requests_a_run_for_a_due_row(db, instance):
    """One row due a second ago and no drain run in flight: a RunRequest."""
    project = _populated_project(db)
    _set_due(db, project, -1)
    assert isinstance(_evaluate(instance), dg.RunRequest)


@pytest.mark.parametrize(("due_in", "expected"), [(60, dg.SkipReason), (3, dg.RunRequest)])
def test_sensor_waits_for_a_row_that_is_not_due_soon(db, instance, due_in, expected):
    """The only row due in 60 s: SkipReason (nothing to do for this tick); due in 3 s, within
    the sensor's 5 s look-ahead: a RunRequest, since the launch itself takes seconds."""
    project = _populated_project(db)
    _set_due(db, project, due_in)
    assert isinstance(_evaluate(instance), expected)


def test_sensor_skips_while_a_drain_run_is_in_flight_unless_the_backlog_is_overdue(db, instance):
    """A due row with a STARTED recalc_drain_job run: SkipReason (that run drains it). The
    backlog overdue by 30 s with one run in flight: a RunRequest for a second worker; with two
    (STARTED + STARTING, the default maximum) in flight: SkipReason. Finished drain runs and
    runs of other jobs do not count as in flight."""
    project = _populated_project(db)
    _set_due(db, project, -1)
    _in_flight(instance, dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE)
    instance.create_run_for_job(
        job_def=force_recalc_job,
        run_config={"ops": {"force_recalc_projects": {"config": {"project_ids": []}}}},
        status=dg.DagsterRunStatus.STARTED,
    )
    assert isinstance(_evaluate(instance), dg.RunRequest)

    _in_flight(instance, dg.DagsterRunStatus.STARTED)
    result = _evaluate(instance)
    assert isinstance(result, dg.SkipReason)
    assert "already queued or running" in (result.skip_message or "")

    _set_due(db, project, -30)
    assert isinstance(_evaluate(instance), dg.RunRequest)

    _in_flight(instance, dg.DagsterRunStatus.STARTING)
    assert isinstance(_evaluate(instance), dg.SkipReason)


#: Ticks measured together: the server's counters are read once before and once after.
COST_TICKS = 10


def test_sensor_tick_costs_one_statement_and_one_session_of_the_catalogue(pg_dsn, instance):
    """The spec's 5-second tick runs all day, mostly on a quiet queue: tried, COST_TICKS ticks
    on a queue with a row due in a minute (the most common case: something waits out its
    debounce), counted by the server (pg_stat_database of the test database, which nothing else
    uses meanwhile). Each tick opens one session and sends one statement: the beat (the spec's
    liveness, CHESSBOARD_RECALC_WORKER_DOWN) and the next row's due time together. A session
    start is a transaction of its own in the counters (the backend's catalog reads)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM chessboard.project_recalc_requests")
        _set_due(conn, _populated_project(conn), 60)
    with database_cost(pg_dsn) as cost:
        for _ in range(COST_TICKS):
            assert isinstance(_evaluate(instance), dg.SkipReason)
    assert cost.sessions == COST_TICKS
    assert cost.transactions <= COST_TICKS * 2


# --- jobs -----------------------------------------------------------------------------------


def test_drain_job_in_process_materializes_the_aggregates_with_counts(db, instance):
    """recalc_drain_job executed in process with the code location's resources (budget 2 s):
    two due projects and one whose recalc raises, plus a row due in 30 s: the run succeeds,
    records one AssetMaterialization of chessboard/aggregates with processed 2, failed 1,
    poisoned 0, and leaves the failed and the not-yet-due rows queued."""
    ok = [_populated_project(db) for _ in range(2)]
    failing = _populated_project(db)
    later = _populated_project(db)
    for project in (*ok, failing):
        _set_due(db, project, -1)
    _set_due(db, later, 30)

    with failing_recalc(db, failing, "broken project"):
        result = recalc_drain_job.execute_in_process(
            run_config=_drain_config(), resources=RESOURCES, instance=instance
        )
    assert result.success
    materializations = result.asset_materializations_for_node("drain_recalc_queue")
    assert len(materializations) == 1
    assert materializations[0].asset_key == CHESSBOARD_AGGREGATES
    metadata = _metadata(materializations[0])
    assert (metadata["processed"], metadata["failed"], metadata["poisoned"]) == (2, 1, 0)
    assert metadata["republished_project"] == 2
    assert set(queued_projects(db)) == {failing, later}
    assert queue_row(db, failing)["attempt_count"] == 1


def test_drain_job_reports_poisoned_rows(db, instance):
    """A queue holding only a poisoned row: the drain run succeeds without touching it and its
    observation of chessboard/aggregates carries poisoned 1 (nothing was materialized)."""
    project = _populated_project(db)
    _poison(db, project, "bad data")
    result = recalc_drain_job.execute_in_process(
        run_config=_drain_config(0.5), resources=RESOURCES, instance=instance
    )
    assert result.success
    assert result.asset_materializations_for_node("drain_recalc_queue") == []
    observations = [
        e.event_specific_data.asset_observation
        for e in result.all_events
        if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION
    ]
    assert [_metadata(o)["poisoned"] for o in observations] == [1]
    assert queue_row(db, project)["attempt_count"] == 5


def test_force_recalc_job_makes_the_projects_due_now(db, instance):
    """force_recalc_job for a project queued 30 s out and a project not queued at all: both rows
    become due now with reason Manual (the queued one's count incremented), and a drain then
    recalculates them; a run with a non-UUID id fails and changes nothing."""
    queued, idle = _populated_project(db), _populated_project(db)
    _set_due(db, queued, 30)
    db.execute("DELETE FROM chessboard.project_recalc_requests WHERE project_id = %s", (idle,))

    bad = force_recalc_job.execute_in_process(
        run_config={"ops": {"force_recalc_projects": {"config": {"project_ids": ["nope"]}}}},
        resources=RESOURCES,
        instance=instance,
        raise_on_error=False,
    )
    assert not bad.success
    assert set(queued_projects(db)) == {queued}

    result = force_recalc_job.execute_in_process(
        run_config={
            "ops": {"force_recalc_projects": {"config": {"project_ids": [str(queued), str(idle)]}}}
        },
        resources=RESOURCES,
        instance=instance,
    )
    assert result.success
    now = db.execute("SELECT now()").fetchone()[0]
    rows = queued_projects(db)
    assert set(rows) == {queued, idle}
    assert all(r["due_at"] <= now and r["last_reason"] == "Manual" for r in rows.values())
    assert rows[idle]["requested_count"] == 1
    assert rows[queued]["requested_count"] >= 2
    drained = recalc_drain_job.execute_in_process(
        run_config=_drain_config(), resources=RESOURCES, instance=instance
    )
    assert (
        _metadata(drained.asset_materializations_for_node("drain_recalc_queue")[0])["processed"]
        == 2
    )
    assert drift(db) == {}


def test_requeue_poisoned_job_resets_the_row(db, instance):
    """requeue_poisoned_job for a poisoned project: attempt_count 0, last_error NULL, due now;
    the next drain run recalculates it and the queue is empty."""
    project = _populated_project(db)
    _poison(db, project, "fixed since")
    result = requeue_poisoned_job.execute_in_process(
        run_config={
            "ops": {"requeue_poisoned_projects": {"config": {"project_ids": [str(project)]}}}
        },
        resources=RESOURCES,
        instance=instance,
    )
    assert result.success
    row = queue_row(db, project)
    assert (row["attempt_count"], row["last_error"]) == (0, None)
    assert row["due_at"] <= db.execute("SELECT now()").fetchone()[0]
    recalc_drain_job.execute_in_process(
        run_config=_drain_config(), resources=RESOURCES, instance=instance
    )
    assert queued_projects(db) == {}
    assert drift(db) == {}


def test_poison_asset_check_fails_naming_the_poisoned_project(db, instance):
    """The no_poisoned_recalc_requests check (run through the code location's check job): passes
    with a clean queue; with one poisoned row and one healthy queued row it fails with severity
    ERROR, naming exactly the poisoned project and its last_error."""
    check_job = defs.resolve_job_def("recalc_poison_check_job")
    clean = check_job.execute_in_process(instance=instance)
    assert [e.passed for e in clean.get_asset_check_evaluations()] == [True]

    poisoned, healthy = _populated_project(db), _populated_project(db)
    _poison(db, poisoned, "numeric field overflow in layout 42")
    assert healthy in queued_projects(db)
    result = check_job.execute_in_process(instance=instance, raise_on_error=False)
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.check_name == "no_poisoned_recalc_requests"
    assert evaluation.asset_key == CHESSBOARD_AGGREGATES
    assert evaluation.passed is False
    assert evaluation.severity == dg.AssetCheckSeverity.ERROR
    metadata = _metadata(evaluation)
    assert metadata["poisoned"] == 1
    assert metadata["project_ids"] == [str(poisoned)]
    rows = metadata["rows"]  # TableMetadataValue.value: its records
    assert [r.data["project_id"] for r in rows.records] == [str(poisoned)]
    assert rows.records[0].data["last_error"] == "numeric field overflow in layout 42"
    clear_queue(db)
